"""Re-planning for another world size from what an earlier plan measured: an elastic run's pool changed.

The model's profile (fake tensors) and its measured compute times do not depend on how many ranks
train it, and the collectives measured for the first world size stand in for the new one: so a
re-plan runs no probe and takes no device time, and the search and the memory model are the ones the
first plan used. Whatever fails reaches the caller as make_plan_for's would (a NoPlanFits where
nothing fits the new world size).
"""

from dataclasses import replace

from osdp_planners.errors import UserError, UserErrors
from osdp_planners.evaluate import Context
from osdp_planners.explanation import PlanResult
from osdp_planners.make_plan import Builder, _planning_failed, plan_in
from osdp_planners.request import PlanRequest
from osdp_planners.time_model import Topology


def context_at(ctx: Context, req: PlanRequest) -> Context:
    """`ctx` for the pool `req` names: its world size and node shape; collectives only where ranks talk."""
    comm = ctx.topo.measured if req.world_size > 1 else None
    return replace(ctx, topo=Topology(req.world_size, req.workers_per_node, ctx.topo.device, comm))


def replan(build: Builder, first: PlanResult, req: PlanRequest) -> PlanResult:
    """The plan for `req` (another world size than `first`'s), from `first`'s profile and measurements."""
    try:
        return plan_in(build, req, context_at(first.context, req))
    except (UserError, UserErrors):
        raise
    except Exception as exc:
        raise _planning_failed(req, exc) from exc
