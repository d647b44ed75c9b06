"""The memory a plan leaves unplanned: on a GPU its predicted reserved peak, not its allocated one, meets the budget."""

import dataclasses

import pytest

from helpers import ZooModel, plan_zoo, zoo_request
from osdp_planners.errors import NoPlanFits, UserError
from osdp_planners.hardware import GIB, get_preset
from osdp_planners.make_plan import check_capacity
from osdp_planners.margin import MemoryMargin
from osdp_planners.plan import Plan


def test_the_reserved_peak_of_a_plan_filling_the_usable_memory_meets_the_budget() -> None:
    """usable() is the allocated peak whose reserve (x 1.25 on a GPU) plus the fixed reserve is the budget
    less its fraction; budget_for() inverts it (to its 1e-4 GiB rounding)."""
    margin = MemoryMargin.default("gpu")
    assert (margin.fraction, margin.reserve_bytes, margin.allocator_overhead) == (0.05, GIB, 0.25)
    budget = 80 * GIB
    usable = margin.usable(budget)
    assert margin.reserved(usable) + GIB == pytest.approx(0.95 * budget)
    assert 0 <= margin.budget_for(usable) - budget <= 1e-4 * GIB
    cpu = MemoryMargin.default("cpu")
    assert cpu.reserved(usable) == usable and cpu.usable(budget) == pytest.approx(0.98 * budget)


def test_a_gpu_plan_records_its_reserved_peak_within_the_budget() -> None:
    """A plan for a GPU pool (times from the preset) states allocated and reserved peaks; the reserved
    one, with the fixed reserve, fits the budget less its fraction; on CPU the two are equal."""
    req = zoo_request("llama", 4, precision="bf16-mixed", limit=GIB // 8)
    gpu = dataclasses.replace(
        req,
        device=get_preset("h100-80gb"),
        margin=MemoryMargin(fraction=0.05, reserve_bytes=GIB // 64, allocator_overhead=0.25),
    )
    plan = plan_zoo(ZooModel("llama", 2), gpu, measure_on=None).plan
    allocated, reserved = plan.predicted.peak_memory_bytes, plan.predicted.reserved_memory_bytes
    assert allocated is not None and reserved is not None
    assert reserved == pytest.approx(1.25 * allocated, abs=1)
    assert reserved + GIB // 64 <= 0.95 * GIB // 8
    assert plan.memory_margin is not None and plan.memory_margin.allocator_overhead == 0.25
    on_cpu = plan_zoo(ZooModel("llama", 2), req, measure_on=None).plan.predicted
    assert on_cpu.reserved_memory_bytes == on_cpu.peak_memory_bytes


def test_a_plan_records_the_margin_it_was_planned_under_and_reads_older_plans() -> None:
    """One margin class: the request's margin is the plan's record, and the usable bytes older plans also
    recorded (derived from the budget) are read and dropped, not refused."""
    margin = MemoryMargin(fraction=0.05, reserve_bytes=GIB // 64, allocator_overhead=0.25)
    req = dataclasses.replace(zoo_request("llama", 4, limit=GIB // 8), margin=margin)
    plan = plan_zoo(ZooModel("llama", 2), req, measure_on=None).plan
    assert plan.memory_margin == margin
    older = plan.model_dump(mode="json")
    older["memory_margin"]["usable_bytes"] = int(margin.usable(GIB // 8))
    assert Plan.model_validate(older) == plan


@pytest.mark.parametrize(
    ("preset", "reported_gib"),
    # The capacities torch's out-of-memory messages state for these GPUs (the lowest seen of each).
    [("a100-40gb", 39.39), ("a100-80gb", 79.14), ("h100-80gb", 79.14), ("h200-141gb", 139.72)],
)
def test_a_gpu_presets_budget_fits_the_gpu_it_names(preset: str, reported_gib: float) -> None:
    """A recipe that names only the preset plans within what CUDA reports; a budget of the marketed
    size does not, and the planner running on such a GPU refuses it naming the key and the fix."""
    req = dataclasses.replace(zoo_request(), device=get_preset(preset), budget_key="hardware.preset")
    capacity = int(reported_gib * GIB)
    check_capacity(dataclasses.replace(req, memory_limit_bytes=get_preset(preset).memory_bytes), capacity, "GPU")
    marketed = int(float(preset.split("-")[1].removesuffix("gb")) * GIB)
    with pytest.raises(UserError) as refused:
        check_capacity(dataclasses.replace(req, memory_limit_bytes=marketed), capacity, "NVIDIA GPU")
    assert refused.value.field == "hardware.preset" and refused.value.value == preset
    assert f"{reported_gib:.2f} GiB" in refused.value.problem and "memory_per_device_gb" in refused.value.fix
    own = dataclasses.replace(req, memory_limit_bytes=marketed, budget_key="planner.memory_limit_gb")
    with pytest.raises(UserError, match=r"lower planner\.memory_limit_gb to at most"):
        check_capacity(own, capacity, "NVIDIA GPU")


def test_a_preset_budget_no_plan_fits_is_named_by_the_preset_and_the_fix_does_not_raise_a_name() -> None:
    """A preset names a device: the refusal names it (not its GiB under the preset's key) and asks for
    larger devices through a preset or hardware.memory_per_device_gb, whose advised size then plans."""
    preset = get_preset("a100-40gb")
    req = dataclasses.replace(
        zoo_request("llama", 2),
        device=preset,
        memory_limit_bytes=GIB // 1024,
        margin=MemoryMargin.default("gpu"),
        budget_key="hardware.preset",
    )
    with pytest.raises(NoPlanFits) as refused:
        plan_zoo(ZooModel("llama", 2), req, measure_on=None)
    err = refused.value
    assert (err.field, err.value) == ("hardware.preset", "a100-40gb"), err
    assert "hardware.memory_per_device_gb" in err.fix and "raise hardware.preset" not in err.fix, err.fix
    assert f"devices of at least {err.advised_gb:.4f} GiB" in err.fix, err.fix
    advised = dataclasses.replace(
        req, memory_limit_bytes=int(err.advised_gb * GIB) + 1, budget_key="hardware.memory_per_device_gb"
    )
    assert plan_zoo(ZooModel("llama", 2), advised, measure_on=None).plan.units
