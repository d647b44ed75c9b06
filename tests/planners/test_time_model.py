"""The CPU-pool step-time model: FSDP2 units a split makes, HSDP over groups of one, calibration to the
model, and the model probe on real gloo ranks."""

from pathlib import Path

import pytest

from helpers import ZooModel, context
from osdp_planners import model_probe
from osdp_planners.comm_probe import STRATEGIES, CommProfile
from osdp_planners.compute_probe import MeasuredTimes
from osdp_planners.hardware import get_preset
from osdp_planners.model_probe import ModelOverheads, calibrate, measure_on_ranks
from osdp_planners.options import Option
from osdp_planners.plan import Strategy
from osdp_planners.profile import Linear1
from osdp_planners.time_model import Topology, comm_seconds, fsdp_units, optimizer_seconds, unit_time

COMM = CommProfile(
    world_size=4,
    bandwidth={"all_gather": 2e8, "reduce_scatter": 1.5e8, "all_reduce": 5e8},
    unit_cost_s={"ddp": 2e-3, "zero2": 4e-3, "zero3": 6e-3},
    tensor_cost_s={"ddp": 2e-4, "zero2": 1e-4, "zero3": 3e-4},
    optimizer_tensor_cost_s={"ddp": 3e-4, "zero2": 3e-4, "zero3": 3e-4},
    step_fixed_s=1e-3,
)


def uniform(strategy: Strategy, world: int) -> Option:
    return Option(strategy, 1 if strategy is Strategy.DDP else world)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("split", [2, 4, 8])
def test_a_split_unit_is_one_fsdp_unit_per_slice_plus_the_rest(family: str, split: int) -> None:
    model = ZooModel(family, 2)("meta")
    profile = context(family).profile
    for unit in profile.units:
        if not unit.linears:
            continue
        linears = [len(list(model.get_submodule(p).parameters())) for p in unit.linears]
        units = fsdp_units(profile, unit.name, Option(Strategy.ZERO3, 4, split))
        assert len(units) == split * len(linears) + 1, unit.name
        assert sorted(units[:-1]) == sorted(t for t in linears for _ in range(split))
        assert sum(units) == unit.tensor_count + (split - 1) * sum(linears), unit.name
        assert fsdp_units(profile, unit.name, Option(Strategy.ZERO3, 4)) == [unit.tensor_count]


def test_hsdp_over_groups_of_one_is_charged_as_replication() -> None:
    ctx = context("llama")
    topo = Topology(4, 4, ctx.topo.device, COMM)
    for unit in ctx.profile.units:
        dp = comm_seconds(ctx.profile, unit.name, Option(Strategy.DDP, 1), topo, 4)
        assert comm_seconds(ctx.profile, unit.name, Option(Strategy.HSDP, 1), topo, 4) == pytest.approx(dp)
        assert comm_seconds(ctx.profile, unit.name, Option(Strategy.HSDP, 2), topo, 4) > dp


def test_zero3_gathers_its_parameters_twice_where_zero2_gathers_them_once() -> None:
    """On a preset (nothing measured) ZeRO-3 all-gathers in forward and again in backward: one more gather of
    the whole unit than ZeRO-2, in bytes as well as in latency (OSDP.md: 3x the bytes of DP's 2x)."""
    ctx = context("llama")
    topo = Topology(4, 4, get_preset("a100-80gb"))
    link = topo.link(4)
    for unit in ctx.profile.units:
        zero2 = comm_seconds(ctx.profile, unit.name, Option(Strategy.ZERO2, 4), topo, 2)
        zero3 = comm_seconds(ctx.profile, unit.name, Option(Strategy.ZERO3, 4), topo, 2)
        gathered = ctx.profile.param_bytes[unit.name] / 2  # bf16 compute copies of fp32 parameters
        one_gather = link.latency_s + gathered * 3 / 4 / link.bandwidth_bytes_per_s
        assert zero3 - zero2 == pytest.approx(one_gather, rel=1e-9), unit.name


def test_checkpointing_costs_the_measured_recomputation_else_the_forward_again() -> None:
    ctx = context("llama")
    topo = Topology(4, 4, ctx.topo.device, COMM)
    names = [u.name for u in ctx.profile.units]
    line = {u: Linear1(1e-3, 2e-3) for u in names}  # a + b x batch: 3 ms of forward at batch 1, 9 at batch 4
    recompute = {u: Linear1(4e-3, 1e-3) for u in names}
    measured = MeasuredTimes(line, line, 1e-9, recompute=recompute)
    forward_only = MeasuredTimes(line, line, 1e-9)
    for unit in names:
        for batch in (1, 4):

            def compute(times: MeasuredTimes, checkpoint: bool, unit: str = unit, batch: int = batch) -> float:
                opt = Option(Strategy.ZERO3, 4, checkpoint=checkpoint)
                return unit_time(ctx.profile, unit, opt, batch, topo, times, 4, False).compute_s

            assert compute(measured, True) - compute(measured, False) == pytest.approx(4e-3 + 1e-3 * batch)
            assert compute(forward_only, True) - compute(forward_only, False) == pytest.approx(1e-3 + 2e-3 * batch)


@pytest.mark.parametrize("added_ms", [(20.0, 30.0, 45.0), (30.0, 50.0, 90.0)])
def test_calibrated_uniform_plans_add_what_was_measured(added_ms: tuple[float, float, float]) -> None:
    ctx = context("llama")
    measured = MeasuredTimes({}, {}, 1e-8)
    overheads = ModelOverheads(
        step_added_s={s: ms / 1e3 for s, ms in zip(STRATEGIES, added_ms, strict=True)},
        optimizer_added_s={"ddp": 6e-3, "zero2": 5e-3, "zero3": 4.5e-3},
    )
    comm = calibrate(
        COMM, overheads, ctx.profile, Topology(4, 4, ctx.topo.device, COMM), 4, measured.optimizer_s_per_param
    )
    topo = Topology(4, 4, ctx.topo.device, comm)
    plain_topo = Topology(4, 4, ctx.topo.device, None)
    for name in STRATEGIES:
        opt = uniform(Strategy(name), 4)
        options = {u.name: opt for u in ctx.profile.units}
        step = sum(comm_seconds(ctx.profile, u, opt, topo, 4) for u in options) + topo.step_fixed_s
        assert step == pytest.approx(overheads.step_added_s[name], rel=1e-9), name
        plain_options = {u: Option(Strategy.DDP, 1) for u in options}
        added_opt = optimizer_seconds(ctx.profile, options, topo, measured) - optimizer_seconds(
            ctx.profile, plain_options, plain_topo, measured
        )
        assert added_opt == pytest.approx(overheads.optimizer_added_s[name], rel=1e-9), name


def test_a_calibration_far_off_the_probes_is_taken_as_noise_and_bounded() -> None:
    ctx = context("llama")
    absurd = ModelOverheads({s: 100.0 for s in STRATEGIES}, {s: 0.0 for s in STRATEGIES})
    comm = calibrate(COMM, absurd, ctx.profile, Topology(4, 4, ctx.topo.device, COMM), 4, 1e-8)
    for name in STRATEGIES:
        opt = uniform(Strategy(name), 4)
        raw = sum(
            comm_seconds(ctx.profile, u.name, opt, Topology(4, 4, ctx.topo.device, COMM), 4) for u in ctx.profile.units
        )
        scaled = sum(
            comm_seconds(ctx.profile, u.name, opt, Topology(4, 4, ctx.topo.device, comm), 4) for u in ctx.profile.units
        )
        assert raw < scaled <= 4 * raw + 1e-12, name


def test_model_probe_times_the_model_on_real_ranks_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    # kept whatever the suite's load makes the probe wait: the rule for busy hosts is test_disk_cache's
    monkeypatch.setattr(model_probe, "quiet", lambda _result: True)
    build = ZooModel("llama", 2)
    flops = {u.name: 1.0 for u in context("llama").profile.units}
    times, overheads = measure_on_ranks(build, 32, 256, flops, 2, "llama-tiny-2")
    assert overheads is not None
    assert all(overheads.step_added_s[s] > 0 for s in STRATEGIES), overheads
    # ZeRO-3 gathers in forward and again in backward, then reduce-scatters; DP all-reduces once
    assert overheads.step_added_s["zero3"] > overheads.step_added_s["ddp"], overheads
    # the batch slope may be fitted flat on a tiny model and a noisy host (clamped at 0), not the time itself
    assert sum(line.at(4) for line in times.forward.values()) > 0
    assert sum(line.at(4) for line in times.backward.values()) > 0 and times.optimizer_s_per_param > 0
    assert len(list(tmp_path.glob("model-*-r2.json"))) == 1
    assert times.cpu_wait_share is not None and 0.0 <= times.cpu_wait_share <= 1.0, "the probe records its host's load"
    again, cached = measure_on_ranks(build, 32, 256, flops, 2, "llama-tiny-2")
    assert again == times and cached == overheads  # read back, not measured again (noise would differ)
