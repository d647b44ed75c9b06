"""Uniform plans: one strategy for every unit (the baselines OSDP is compared against)."""

from torch import nn

from osdp_planners.plan import Margin, Plan, Strategy, UnitPlan
from osdp_planners.request import PlanRequest
from osdp_planners.units import Unit, find_units, structure_hash


def group_size(strategy: Strategy, req: PlanRequest) -> int:
    if strategy is Strategy.DDP:
        return 1
    if strategy is Strategy.HSDP:
        return req.default_hsdp_group()
    return req.world_size


def unit_plans(units: list[Unit], strategy: Strategy, req: PlanRequest) -> list[UnitPlan]:
    g = group_size(strategy, req)
    return [
        UnitPlan(name=u.name, modules=list(u.modules), strategy=strategy, shard_group_size=g, param_count=u.param_count)
        for u in units
    ]


def make_plan(
    model: nn.Module, req: PlanRequest, units: list[UnitPlan], micro_batch_size: int, grad_accum_steps: int
) -> Plan:
    """Assemble the plan document for `model` (predictions filled in by the cost model, if any)."""
    return Plan(
        planner=req.planner,
        model=req.model_label,
        structure_hash=structure_hash(model),
        world_size=req.world_size,
        nodes=req.nodes,
        workers_per_node=req.workers_per_node,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seq_len=req.seq_len,
        precision=req.precision,
        compile=req.compile,
        memory_limit_bytes=req.memory_limit_bytes,
        memory_margin=Margin(
            fraction=req.margin.fraction,
            reserve_bytes=req.margin.reserve_bytes,
            allocator_overhead=req.margin.allocator_overhead,
            usable_bytes=int(req.usable_memory_bytes),
        ),
        units=units,
    )


def uniform_plan(
    model: nn.Module, req: PlanRequest, strategy: Strategy, micro_batch_size: int, grad_accum_steps: int
) -> Plan:
    units = unit_plans(find_units(model, req.seq_len), strategy, req)
    return make_plan(model, req, units, micro_batch_size, grad_accum_steps)
