"""OSDP planners: decide per sharding unit how its parameters are held, and the batch size."""

from torch import nn

from osdp_planners.plan import Plan, Strategy
from osdp_planners.request import PlanningError, PlanRequest
from osdp_planners.uniform import uniform_plan

__all__ = ["Plan", "PlanRequest", "PlanningError", "make_plan_for"]


def _fixed_batch(req: PlanRequest) -> tuple[int, int]:
    if req.micro_batch_size is None:
        raise PlanningError("train.micro_batch_size", "auto", f"planner {req.planner!r} does not choose batch sizes",
                            "give a number, or use planner.name=osdp")
    if req.global_batch_size is None:
        return req.micro_batch_size, 1
    return req.micro_batch_size, req.global_batch_size // (req.micro_batch_size * req.world_size)


def make_plan_for(model: nn.Module, req: PlanRequest) -> Plan:
    """The plan `req.planner` makes for `model` (built on any device; meta is enough)."""
    if req.planner in {s.value for s in Strategy}:
        micro, accum = _fixed_batch(req)
        return uniform_plan(model, req, Strategy(req.planner), micro, accum)
    raise PlanningError("planner.name", req.planner, "is not a known planner", "use ddp, zero2, zero3 or hsdp")
