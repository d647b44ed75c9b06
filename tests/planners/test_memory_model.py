"""Predicted peak memory vs what one rank really holds, measured with FSDP2 in a fake process group.

The prediction (planners/osdp_planners/memory_model.py) is built from a single-process activation profile and a
model of FSDP2's buffers; the measurement runs the real FSDP2 code on fake tensors for rank 0 of a
4-rank job under torch's memory tracker. They share no code beyond the plan.
"""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from osdp_planners.hardware import get_preset
from osdp_planners.memory_model import simulate
from osdp_planners.options import Option
from osdp_planners.plan import Plan, Strategy
from osdp_planners.profiler import profile_model
from osdp_planners.request import PlanRequest
from osdp_planners.uniform import uniform_plan
from osdp_platform.runtime.fake_rank import measure_fake_rank
from osdp_platform.zoo import build_zoo_model

WORLD, BATCH, SEQ = 4, 4, 64
UNDER = 0.02  # a plan predicted to fit must fit
# over-prediction only wastes memory; the most here is split2's, where the attention's backward
# all-gather is counted over the split MLP's whole backward (memory_model.py), 5% on this small model
OVER = 0.07

# GQA and OPT shapes are drawn by tests/planners/test_memory_property.py
SHAPES: dict[str, Callable[[], nn.Module]] = {
    "llama-mha": lambda: build_zoo_model(
        "llama", "tiny", dim=256, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=688, vocab_size=512
    ),
    "gpt2-tied": lambda: build_zoo_model("gpt2", "tiny", dim=192, n_layers=3, n_heads=4, vocab_size=512),
    # logits dwarf the blocks' activations: the peak is in the loss's own backward
    "llama-wide-vocab": lambda: build_zoo_model(
        "llama", "tiny", dim=64, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=172, vocab_size=4096
    ),
}


def _variants(base: Plan) -> dict[str, Plan]:
    def edit(pred: Callable[[int, str], bool], **update: object) -> Plan:
        units = [u.model_copy(update=update) if pred(i, u.name) else u for i, u in enumerate(base.units)]
        return base.model_copy(update={"units": units})

    return {
        "mixed": edit(lambda i, _n: i % 2 == 1, strategy=Strategy.DDP, shard_group_size=1),
        "split2": edit(lambda _i, n: "mlp" in n, split=2),
        "checkpointed": edit(lambda _i, n: "layers" in n, checkpoint=True),
    }


def _plans(meta: nn.Module) -> dict[str, Plan]:
    req = PlanRequest("test", "test", 1, WORLD, get_preset("cpu"), 8 << 30, SEQ, BATCH, None)
    plans = {s.value: uniform_plan(meta, req, s, BATCH, 1) for s in Strategy}
    plans.update(_variants(plans["zero3"]))
    return plans


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_predicted_peak_matches_the_fake_rank(shape: str) -> None:
    build = SHAPES[shape]
    with torch.device("meta"):
        meta = build()
    vocab = meta.config.vocab_size
    profile = profile_model(lambda _device: build(), SEQ, vocab)
    errors, measured = {}, {}
    for name, plan in _plans(meta).items():
        measured[name] = measure_fake_rank(build, plan, vocab).peak_bytes
        predicted = simulate(profile, {u.name: Option.of(u) for u in plan.units}, BATCH).peak
        errors[name] = predicted / measured[name] - 1
    bad = {k: f"{v:+.1%}" for k, v in errors.items() if not -UNDER <= v <= OVER}
    assert not bad, f"{shape}: predictions outside -{UNDER:.0%}..+{OVER:.0%} of the measured peak: {bad}"
    # the measurement itself must tell the strategies apart, or the comparison proves nothing
    assert measured["zero3"] < measured["zero2"] < measured["ddp"]
    assert measured["checkpointed"] < measured["zero3"]


def test_a_split_units_gradient_shards_count_from_each_slices_backward() -> None:
    """Each slice of a split Linear is reduce-scattered as its own backward ends, so its gradient
    shard is held during the rest of the unit's backward, where the peak of a split MLP lies when
    the attention before it keeps its parameters (ZeRO-2: no backward all-gather to over-count).
    Two ranks, so that the shards weigh: counted from the unit's reduce-scatter, this plan's
    peak was under-predicted by 2.2%, more than the planner's margin on CPUs."""

    def build() -> nn.Module:
        return build_zoo_model("opt", "tiny")

    with torch.device("meta"):
        meta = build()
    vocab = meta.config.vocab_size
    req = PlanRequest("test", "test", 1, 2, get_preset("cpu"), 8 << 30, 32, 2, None)
    plan = uniform_plan(meta, req, Strategy.ZERO2, 2, 1)
    units = [
        u.model_copy(update={"strategy": Strategy.ZERO3, "split": 4}) if "mlp" in u.name else u for u in plan.units
    ]
    plan = plan.model_copy(update={"units": units})
    measured = measure_fake_rank(build, plan, vocab).peak_bytes
    predicted = simulate(profile_model(lambda _device: build(), 32, vocab), {u.name: Option.of(u) for u in units}, 2)
    assert measured * (1 - UNDER / 4) <= predicted.peak <= measured * (1 + OVER), (predicted.peak, measured)


def test_a_truncated_profile_keeps_the_full_models_forward_order() -> None:
    """The profile runs two of the identical blocks; the blocks it stands in for must follow each other
    whole (block 2's attention after block 1's MLP), or every later event sits at the wrong time."""

    def build(_device: str = "cpu") -> nn.Module:
        return build_zoo_model("llama", "tiny", dim=64, n_layers=4, n_heads=2, n_kv_heads=2, ffn_dim=96, vocab_size=128)

    model = build()
    profiled = [m.path for m in profile_model(build, 16, 128).modules]
    order: list[str] = []
    for path, module in model.named_modules():
        if path in profiled:
            module.register_forward_pre_hook(lambda _m, _a, path=path: order.append(path))
    model(torch.randint(0, 128, (1, 16)))
    assert profiled == list(dict.fromkeys(order))
