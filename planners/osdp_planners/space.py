"""What the planner chooses from: the batches a request allows and every option of every unit."""

from osdp_planners.evaluate import Context
from osdp_planners.options import Option, unit_options
from osdp_planners.request import PlanRequest
from osdp_planners.units import ROOT

MAX_MICRO_BATCH = 1024


def batch_candidates(req: PlanRequest) -> list[tuple[int, int]]:
    """(micro batch, accumulation steps) pairs the request allows."""
    ws = req.world_size
    if req.global_batch_size is not None:
        per_rank = req.global_batch_size // ws
        micros = (
            [req.micro_batch_size] if req.micro_batch_size else [b for b in range(1, per_rank + 1) if per_rank % b == 0]
        )
        return [(b, per_rank // b) for b in micros]
    if req.micro_batch_size is not None:
        return [(req.micro_batch_size, 1)]
    sizes = []
    b = 1
    while b <= MAX_MICRO_BATCH:
        sizes.append((b, 1))
        b *= 2
    return sizes


def splittable(ctx: Context, unit: str) -> bool:
    return bool(ctx.profile.linear_bytes[unit])


def checkpointable(ctx: Context, unit: str) -> bool:
    return unit in ctx.profile.by_unit and unit != ROOT  # the root is the whole model


def unit_option_lists(ctx: Context, req: PlanRequest) -> dict[str, list[Option]]:
    """Every option of every unit the topology and the unit's shape allow."""
    return {
        u.name: unit_options(
            req.world_size, req.workers_per_node, req.nodes, splittable(ctx, u.name), checkpointable(ctx, u.name)
        )
        for u in ctx.profile.units
    }
