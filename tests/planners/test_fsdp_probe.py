"""What FSDP2 adds on a GPU rank, measured under the fake process group (fsdp_probe, on a chain of layers
for a model too large to probe whole), and how the time model charges it: per byte, per further unit of
a split, per DTensor in the optimizer step. Run here on CPU, where the same code measures CPU costs."""

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from helpers import ZooModel, context
from osdp_planners.block_probe import CHAIN, _called, _capture, _fsdp_added, chain_length, fsdp_layer
from osdp_planners.comm_probe import shard_uniform
from osdp_planners.compute_probe import TIMING_BATCHES, MeasuredTimes
from osdp_planners.fsdp_probe import Added, Chain, added_costs, charge, finer, measure_fsdp_costs
from osdp_planners.options import Option
from osdp_planners.plan import Strategy
from osdp_planners.profile import Linear1
from osdp_planners.time_model import optimizer_seconds, unit_time
from osdp_planners.units import ROOT, Unit, find_units
from structures import STRUCTURES


def test_fsdp2_copies_are_charged_per_byte_on_the_compute_stream() -> None:
    """A GPU-measured cost per byte adds to a unit's compute, before overlap with its collectives."""
    ctx = context("llama")
    unit = ctx.profile.units[1].name
    base = MeasuredTimes({unit: Linear1(0.01, 0.0)}, {unit: Linear1(0.02, 0.0)}, 1e-9)
    costly = dataclasses.replace(base, fsdp_s_per_byte={"zero3": Linear1(1e-9, 0.0), "ddp": Linear1(0.0, 0.0)})
    zero3, dp = Option(Strategy.ZERO3, 4), Option(Strategy.DDP, 1)
    nbytes = ctx.profile.param_bytes[unit]
    plain = unit_time(ctx.profile, unit, zero3, 1, ctx.topo, base, 4, True).compute_s
    assert plain == pytest.approx(0.03)
    assert unit_time(ctx.profile, unit, zero3, 1, ctx.topo, costly, 4, True).compute_s == pytest.approx(
        0.03 + 1e-9 * nbytes
    )
    assert unit_time(ctx.profile, unit, dp, 1, ctx.topo, costly, 4, True).compute_s == pytest.approx(0.03)
    alone = dataclasses.replace(ctx.topo, world_size=1, workers_per_node=1)  # no FSDP2 runs there (apply.py)
    assert unit_time(ctx.profile, unit, zero3, 1, alone, costly, 4, True).compute_s == pytest.approx(0.03)


def test_the_optimizer_is_charged_what_each_dtensor_adds_where_fsdp2_runs() -> None:
    """A GPU probe's cost per DTensor adds to the optimizer step once per parameter tensor of each FSDP2
    unit, at the plan's strategy; a world of one runs no FSDP2 and is charged none of it."""
    for workers, charged in ((4, True), (1, False)):
        ctx = context("llama", workers=workers)
        lines = {u.name: Linear1(0.01, 0.0) for u in ctx.profile.units}
        base = MeasuredTimes(lines, lines, 1e-9)
        costly = dataclasses.replace(base, optimizer_tensor_cost_s={"zero3": 1e-3, "zero2": 0.5})
        options = {u.name: Option(Strategy.ZERO3, workers) for u in ctx.profile.units}
        added = optimizer_seconds(ctx.profile, options, ctx.topo, costly) - optimizer_seconds(
            ctx.profile, options, ctx.topo, base
        )
        tensors = sum(ctx.profile.tensor_count[u] for u in options)
        assert added == pytest.approx(1e-3 * tensors if charged else 0.0)


def test_fsdp2_costs_follow_the_micro_batch_between_the_timing_batches() -> None:
    """FSDP2's host work hides behind a larger batch's compute: its cost per byte is measured at both
    timing batches and charged at the micro batch, held at the nearer measurement outside them."""
    ctx = context("llama")
    unit = ctx.profile.units[1].name
    b1, b2 = TIMING_BATCHES
    times = MeasuredTimes(
        {unit: Linear1(0.0, 0.0)}, {unit: Linear1(0.0, 0.0)}, 0.0, {"zero2": Linear1.fit(4e-12, 1e-12, b1, b2)}
    )
    assert times.fsdp_at("zero2", b1)[0] == pytest.approx(4e-12)
    assert times.fsdp_at("zero2", b2)[0] == pytest.approx(1e-12)
    assert 1e-12 < times.fsdp_at("zero2", (b1 + b2) // 2)[0] < 4e-12
    assert times.fsdp_at("zero2", 4 * b2)[0] == pytest.approx(1e-12), "not the line's guess (negative here)"
    assert times.fsdp_at("zero3", b1) == (0.0, 0.0), "not measured: nothing"
    nbytes = ctx.profile.param_bytes[unit]
    for batch in (b1, b2, 4 * b2):
        charged = unit_time(ctx.profile, unit, Option(Strategy.ZERO2, 4), batch, ctx.topo, times, 4, True).compute_s
        assert charged == pytest.approx(times.fsdp_at("zero2", batch)[0] * nbytes)


def test_each_further_unit_of_a_split_is_charged_what_one_costs() -> None:
    """A split makes each slice of a unit's Linears an FSDP2 unit (the rest, if any, one more): each unit
    beyond the one an unsplit option has adds the measured cost per unit; an unsplit option adds none."""
    ctx = context("llama")
    unit = next(u.name for u in ctx.profile.units if ctx.profile.linear_tensors[u.name])
    zero = Linear1(0.0, 0.0)
    per_unit = {"zero3": Linear1(1e-3, 0.0), "zero2": Linear1(0.5, 0.0)}
    times = MeasuredTimes({unit: zero}, {unit: zero}, 0.0, fsdp_s_per_unit=per_unit)
    linears = len(ctx.profile.linear_tensors[unit])
    rest = ctx.profile.tensor_count[unit] > sum(ctx.profile.linear_tensors[unit])
    for split, further in ((1, 0), (2, 2 * linears + rest - 1), (4, 4 * linears + rest - 1)):
        option = Option(Strategy.ZERO3, 4, split)
        assert unit_time(ctx.profile, unit, option, 1, ctx.topo, times, 4, True).compute_s == pytest.approx(
            1e-3 * further
        )


def test_a_split_is_sharded_as_the_runtime_shards_it() -> None:
    """finer: each splittable Linear a unit of its own, then the unit over what it has left; a unit made
    only of Linears (transformers' MLP) leaves nothing, so it is no unit of its own, and a Linear that is
    one of a unit's modules leaves the unit."""
    norm, attn = nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    fine = finer([[norm, attn], [mlp]], [list(attn), [mlp[0], mlp[2]]])
    assert fine == [[attn[0]], [attn[1]], [mlp[0]], [mlp[2]], [norm, attn]]
    up, norm2 = nn.Linear(8, 32), nn.LayerNorm(32)  # PyTorch's encoder layer: linear1 and norm1, one unit
    assert finer([[up, norm2]], [[up]]) == [[up], [norm2]]


def test_fsdp2_costs_are_measured_for_a_rank_under_the_fake_group() -> None:
    """On CPU FSDP2's hooks cost far more than its copies; the probe runs and finds every strategy adds time.
    At the batches a plan far past the usual ones is timed again at (4 and its own), the lines charged
    run through what was measured at both."""
    build = ZooModel("llama", 2)
    batches = (TIMING_BATCHES[-1], 16)
    plain_s = dict.fromkeys(batches, 0.0)
    added = measure_fsdp_costs(build, 32, 256, torch.device("cpu"), 4, "bf16-mixed", plain_s, "adamw")
    assert set(added) == {"ddp", "zero2", "zero3"}
    assert all(s > 0 for a in added.values() for s in a.seconds.values())
    tensors = len(list(build("meta").parameters()))
    assert all(a.tensors == tensors and a.optimizer_s > 0 for a in added.values())
    assert all(set(a.seconds) == set(a.unit_seconds) == set(batches) for a in added.values())
    assert not torch.distributed.is_initialized(), "the probe's process group is gone"
    lines = {u.name: Linear1(0.0, 0.0) for u in find_units(build("meta"), 32)}
    charged = charge(MeasuredTimes(lines, lines, 0.0, batches=batches), added)
    for strategy, a in added.items():
        for batch in batches:
            per_byte, per_unit = charged.fsdp_at(strategy, batch)
            assert per_byte * a.nbytes == pytest.approx(a.seconds[batch]), (strategy, batch)
            assert per_unit == pytest.approx(a.unit_seconds[batch]), (strategy, batch)


def test_fsdp2_costs_of_a_chain_are_per_byte_of_its_global_size_and_its_optimizer_steps_the_shards() -> None:
    """A model too large for the device is charged FSDP2's costs measured on copies of a layer, each unit
    its own, their bytes counted whole (a DTensor's numel is global); the optimizer steps the rank's
    shards: a quarter of the elements at a world of 4 under ZeRO, all of them under DP."""
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    elements = sum(p.numel() for p in block.parameters())
    x = torch.randn(8, 64, requires_grad=True)
    seen: list[int] = []

    def sharded(strategy: str, meshes: dict[str, DeviceMesh], fine: bool) -> nn.Module:
        copies = [copy.deepcopy(block), copy.deepcopy(block)]
        units, linears = [[b] for b in copies], [[b[0], b[2]] for b in copies]
        chain = Chain(units, units, linears)
        shard_uniform(chain, finer(units, linears) if fine else units, strategy, meshes)
        units_made = sum(isinstance(m, FSDPModule) for m in chain.modules())
        assert units_made == (5 if fine else 3)  # the chain and its blocks, or the chain and its Linears
        if not fine:
            seen.append(sum(p.numel() * p.element_size() for p in chain.parameters()))
        return chain

    def run(chain: nn.Module, batch: int) -> None:
        torch.stack(chain([((x[:batch],), {})])).sum().backward()

    added = added_costs(sharded, run, torch.device("cpu"), 4, dict.fromkeys(TIMING_BATCHES, 0.0), "adamw")
    assert set(added) == {"ddp", "zero2", "zero3"}
    assert all(set(a.seconds) == set(TIMING_BATCHES) and min(a.seconds.values()) > 0 for a in added.values())
    assert seen == [2 * 4 * elements] * 3 and all(a.nbytes == 2 * 4 * elements for a in added.values())
    assert all(a.tensors == 8 and a.optimizer_s > 0 for a in added.values())
    assert added["ddp"].local_params == 2 * elements
    assert added["zero2"].local_params == added["zero3"].local_params == 2 * elements // 4
    assert not torch.distributed.is_initialized(), "the probe's process group is gone"


def test_fsdp2_costs_are_charged_per_byte_and_the_optimizers_per_dtensor_beyond_its_rate() -> None:
    times = MeasuredTimes({}, {}, optimizer_s_per_param=1e-9)
    added = {"zero3": Added({1: 0.03, 4: 0.012}, 3_000_000, {1: 2e-3, 4: 5e-4}, 0.005, 40, 1_000_000)}
    charged = charge(times, added)
    assert charged.fsdp_s_per_byte["zero3"].at(1) == pytest.approx(1e-8)
    assert charged.fsdp_s_per_byte["zero3"].at(4) == pytest.approx(4e-9)
    assert charged.fsdp_s_per_unit["zero3"].at(1) == pytest.approx(2e-3)
    assert charged.fsdp_s_per_unit["zero3"].at(4) == pytest.approx(5e-4)
    assert charged.optimizer_tensor_cost_s == {"zero3": pytest.approx((0.005 - 0.001) / 40)}
    cheap = {"zero3": dataclasses.replace(added["zero3"], optimizer_s=0.0005)}
    assert charge(times, cheap).optimizer_tensor_cost_s == {"zero3": 0.0}, "a DTensor never makes a step cheaper"


def test_the_block_probe_measures_fsdp2_on_a_chain_of_a_decoders_layers() -> None:
    """A decoder's attention and MLP repeat (the embedding and head are larger but one of a kind): FSDP2's
    cost is measured on CHAIN copies of the first layer's two units, each its own unit."""
    meta = ZooModel("llama", 3)("meta")
    units = [u for u in find_units(meta, 32) if u.name != ROOT]
    layer = fsdp_layer(meta, units)
    assert [[p.rsplit(".", 1)[-1] for p in unit.modules] for unit in layer] == [["attn"], ["mlp"]], layer
    assert {p.split(".")[1] for unit in layer for p in unit.modules} == {"0"}, "the first layer's"
    calls = {
        b: [_capture(meta, [p], b, 32, torch.float32).calls[p] for unit in layer for p in unit.modules]
        for b in TIMING_BATCHES
    }
    added = _fsdp_added(meta, layer, calls, torch.device("cpu"), "fp32", 2, "adamw")
    assert set(added) == {"ddp", "zero2", "zero3"}
    assert all(set(a.seconds) == set(TIMING_BATCHES) for a in added.values())
    assert {a.nbytes for a in added.values()} == {CHAIN * 4 * sum(u.param_count for u in layer)}
    assert {a.tensors for a in added.values()} == {CHAIN * sum(u.tensor_count for u in layer)}


@pytest.mark.parametrize("name", ["hf_like", "torch_encoder", "tied_across"])
def test_the_layer_chain_runs_for_other_layouts(name: str) -> None:
    """Units of two modules (a norm joined to its attention), three kinds to a layer (PyTorch's encoder),
    and a model whose repeating units hold too little of it to stand for it: its largest unit alone,
    there a tied embedding and head, which stay tied in each copy."""
    with torch.device("meta"):
        meta = STRUCTURES[name]()
    units = [u for u in find_units(meta, 16) if u.name != ROOT]
    layer = fsdp_layer(meta, units)
    largest = max(units, key=lambda u: u.param_count)
    assert (layer == [largest]) == (name == "tied_across"), layer
    called = [p for unit in layer for p in unit.modules]
    calls = {b: [_capture(meta, [p], b, 16, torch.float32).calls[p] for p in called] for b in TIMING_BATCHES}
    added = _fsdp_added(meta, layer, calls, torch.device("cpu"), "bf16-mixed", 2, "adamw")
    assert {a.nbytes for a in added.values()} == {CHAIN * 4 * sum(u.param_count for u in layer)}


def test_the_chain_is_shorter_where_its_layers_would_crowd_the_gpu() -> None:
    """Four copies of a 7b layer (202M parameters) fit half of an 80 GiB GPU at 20 bytes each; of a 70b
    layer (856M) only two do, and a layer larger still is chained twice all the same; a CPU host chains four."""
    gpu = 80 * 2**30
    assert chain_length(202_000_000, gpu) == CHAIN == 4
    assert chain_length(856_000_000, gpu) == 2
    assert chain_length(5_000_000_000, gpu) == 2
    assert chain_length(5_000_000_000, None) == CHAIN


def test_a_layers_module_inside_another_of_its_modules_is_not_called_twice() -> None:
    layer = _units(("blocks.0.norm",), ("blocks.0",), ("blocks.0.mlp", "blocks.0.mlp_norm"))
    assert _called(layer) == ["blocks.0"]
    assert _called(_units(("a.attn", "a.norm"), ("a.mlp",))) == ["a.attn", "a.norm", "a.mlp"]


def _units(*modules: tuple[str, ...]) -> list[Unit]:
    return [Unit("+".join(m), m, 1, (), 1) for m in modules]
