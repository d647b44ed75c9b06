"""Advice when nothing fits: the least memory a plan needs, the budget to ask for, and the devices.

The least footprint is also a candidate of the osdp search (search_osdp), since the knapsack's
memory bound is conservative and a plan it rejects may fit when simulated.
"""

import dataclasses

from osdp_planners.batch_search import AUTO_MILP_BINARIES, AUTO_TIME_LIMIT_S, candidates, unit_costs
from osdp_planners.choice import Choice, describe
from osdp_planners.errors import NoPlanFits
from osdp_planners.evaluate import Bound, Context, evaluate
from osdp_planners.hardware import GIB
from osdp_planners.memory_model import simulate
from osdp_planners.milp import TIME_LIMIT_S, least_peak
from osdp_planners.options import SPLITS, Option
from osdp_planners.plan import Strategy
from osdp_planners.request import PlanRequest
from osdp_planners.search import least_bound
from osdp_planners.space import batch_candidates, checkpointable, splittable, unit_option_lists
from osdp_planners.uniform import uniform_footprint

MAX_NODES_ADVISED = 1024  # beyond this many nodes the advice stops looking and says devices will not do


def _use_milp(mode: str, binaries: int) -> bool:
    return mode == "milp" or (mode == "auto" and binaries <= AUTO_MILP_BINARIES)


def _milp_time_limit(mode: str) -> float:
    return TIME_LIMIT_S if mode == "milp" else AUTO_TIME_LIMIT_S


def smallest_footprint(ctx: Context, req: PlanRequest) -> Choice:
    """The least memory a plan needs, as far as the planner can tell, at the smallest batch: the plan
    with the least simulated peak where the exact program runs (see osdp.search_batch), the plan that
    minimises the search's memory bound, or a uniform ZeRO-3 plan (every split factor, with and
    without checkpointing: splitting adds buffers, so more is not always less), whichever simulates lower."""
    return _least(footprint_candidates(ctx, req))


def _least(plans: list[Choice]) -> Choice:
    return min(plans, key=lambda c: c.evaluation.peak_bytes)


def footprint_candidates(ctx: Context, req: PlanRequest) -> list[Choice]:
    """The plans smallest_footprint chooses from, each evaluated at the smallest batch."""
    batch, accum = min(batch_candidates(req))
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    bound = Bound(ctx, batch, accum)
    bound.add_neighbour_buffers(options)
    costs = unit_costs(ctx, bound, units, options, batch, accum)
    choices = [least_bound(candidates(bound, units, options, costs))]
    if _use_milp(req.search, sum(len(options[u]) for u in units)):
        exact = least_peak(bound, units, options, costs, _milp_time_limit(req.search))
        choices += [] if exact is None else [exact]
    plans = [{u: options[u][i] for u, i in zip(units, c, strict=False)} for c in choices]
    for split in SPLITS:
        for ckpt in (False, True):
            plans.append(
                {
                    u.name: Option(
                        Strategy.ZERO3,
                        req.world_size,
                        split if splittable(ctx, u.name) else 1,
                        ckpt and checkpointable(ctx, u.name),
                    )
                    for u in ctx.profile.units
                }
            )
    return [Choice(p, batch, accum, evaluate(ctx, p, batch, accum)) for p in plans]


def _nodes_to_fit(ctx: Context, req: PlanRequest, plan: Choice) -> int | None:
    """The fewest nodes on which `plan`, its options sharded over the whole pool regrouped over every
    device, fits: the states shrink as 1/devices, activations do not. None within MAX_NODES_ADVISED."""

    def peak(nodes: int) -> float:
        n = nodes * req.workers_per_node
        opts = {
            u: dataclasses.replace(o, shard_group_size=n) if o.shard_group_size == req.world_size else o
            for u, o in plan.options.items()
        }
        batch, accum = plan.micro_batch_size, plan.grad_accum_steps
        return simulate(ctx.profile, opts, batch, ctx.compute_bytes, ctx.optimizer, accum, ctx.overlap, ctx.alone).peak

    if peak(MAX_NODES_ADVISED) > ctx.usable_memory_bytes:
        return None
    lo, hi = req.nodes, MAX_NODES_ADVISED  # the peak falls with the nodes: the first that fits, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if peak(mid) <= ctx.usable_memory_bytes else (mid, hi)
    return hi


def nodes_to_fit(ctx: Context, req: PlanRequest, plans: list[Choice]) -> int | None:
    """The fewest nodes of req.workers_per_node devices of this size on which one of `plans` (those of
    footprint_candidates) fits, sharded over every device. Such a plan is in the planner's space there,
    so a plan fits there (the planner may find one on fewer). None on a single device (nothing is sharded
    to regroup), or if no pool of up to MAX_NODES_ADVISED nodes does (what a device holds alone is too much)."""
    if req.world_size < 2:
        return None
    found = [n for c in plans if (n := _nodes_to_fit(ctx, req, c)) is not None]
    return min(found, default=None)


def infeasible(ctx: Context, req: PlanRequest) -> NoPlanFits:
    """Why nothing fits, with the least budget that would fit a plan of this planner."""
    uniform = req.planner not in ("osdp", "manual")
    plans = [] if uniform else footprint_candidates(ctx, req)
    low = uniform_footprint(ctx, req, Strategy(req.planner)) if uniform else _least(plans)
    need = low.evaluation.peak_bytes
    fixed = req.micro_batch_size
    batch = "at any batch size" if fixed is None else f"at micro batch {fixed} (train.micro_batch_size)"
    what = f"no {req.planner} plan fits {batch}" if uniform else f"no plan fits {batch}"
    shorter = "shorten data.seq_len" + (", or lower train.micro_batch_size" if fixed is not None and fixed > 1 else "")
    advised = req.margin.budget_for(need) / GIB
    at_least = f"at least {advised:.4f} GiB (the footprint plus the {req.margin.describe()} margin)"
    more = (
        f"train on devices of {at_least}: a larger preset, or hardware.memory_per_device_gb"
        if req.budget_by_preset
        else f"raise {req.budget_key} to {at_least}"
    )
    nodes = nodes_to_fit(ctx, req, plans) if plans else None
    if nodes is not None:
        devices = nodes * req.workers_per_node
        fix = (
            f"{more}; or train on {nodes} node(s) of {req.workers_per_node} such devices ({devices} in all: "
            f"a plan fits there, sharded over every device), or {shorter}"
        )
    elif plans and req.world_size > 1:
        fix = (
            f"{more}, or {shorter}; more devices will not do: sharded over {MAX_NODES_ADVISED} nodes, "
            "what each device holds of its own (its activations, the units it gathers) is still over the budget"
        )
    else:
        fix = f"{more}; or add devices, or {shorter}"
    if uniform:
        mixed = req.margin.budget_for(smallest_footprint(ctx, req).evaluation.peak_bytes) / GIB
        fix += f"; or use planner.name=osdp, which mixes strategies and fits from {mixed:.4f} GiB"
    return NoPlanFits(
        req.budget_key,
        req.budget_value,
        f"{what}: the smallest footprint the planner finds is {need / GIB:.4f} GiB per device "
        f"({describe(low.options)}; micro batch {low.micro_batch_size}), and {ctx.usable_memory_bytes / GIB:.4f} GiB "
        f"of the budget is usable after the {req.margin.describe()} margin",
        fix,
        advised,
    )
