"""The OSDP planner and the cost-model view of the uniform baselines.

For every candidate micro batch it finds the fastest per-unit choice of strategy, shard group, split
and checkpointing whose memory fits, then keeps the batch with the highest throughput (samples/s),
not the shortest step, which would always favour the smallest batch.
"""

from dataclasses import dataclass

from torch import nn

from osdp_planners.errors import UserError
from osdp_planners.evaluate import Bound, Context, Evaluation, evaluate, unit_seconds
from osdp_planners.options import SPLITS, Option, unit_options
from osdp_planners.plan import Baseline, Plan, Predicted, Strategy, UnitPlan
from osdp_planners.request import PlanRequest
from osdp_planners.search import Candidate, least_bound, solve
from osdp_planners.uniform import group_size, make_plan
from osdp_planners.units import ROOT

MAX_MICRO_BATCH = 1024
GIB = 1024**3


@dataclass(frozen=True)
class Choice:
    options: dict[str, Option]
    batch: int
    accum: int
    evaluation: Evaluation


def batch_candidates(req: PlanRequest) -> list[tuple[int, int]]:
    """(micro batch, accumulation steps) pairs the request allows."""
    ws = req.world_size
    if req.global_batch_size is not None:
        per_rank = req.global_batch_size // ws
        micros = [req.micro_batch_size] if req.micro_batch_size else [
            b for b in range(1, per_rank + 1) if per_rank % b == 0]
        return [(b, per_rank // b) for b in micros]
    if req.micro_batch_size is not None:
        return [(req.micro_batch_size, 1)]
    sizes = []
    b = 1
    while b <= MAX_MICRO_BATCH:
        sizes.append((b, 1))
        b *= 2
    return sizes


def _splittable(ctx: Context, unit: str) -> bool:
    return bool(ctx.profile.linear_bytes[unit])


def _checkpointable(ctx: Context, unit: str) -> bool:
    return unit in ctx.profile.by_unit and unit != ROOT  # the root is the whole model


def _time_key(ctx: Context, bound: Bound, unit: str) -> tuple[object, ...]:
    """What a unit's step times depend on: identical blocks share them instead of rescoring."""
    measured = None if ctx.measured is None else (ctx.measured.forward.get(unit), ctx.measured.backward.get(unit))
    flops = tuple(m.fwd_flops for m in ctx.profile.by_unit.get(unit, []))
    return bound.signature(unit), ctx.profile.tensor_count[unit], measured, flops


def search_candidates(ctx: Context, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
                      ) -> list[list[Candidate]]:
    """Every unit's candidates for the knapsack, plus one for the loss and optimizer step's base."""
    bound = Bound(ctx, batch, accum)
    bound.add_neighbour_buffers(options)
    times: dict[tuple[object, ...], list[float]] = {}
    out = []
    for u in units:
        key = (_time_key(ctx, bound, u), tuple(options[u]))
        if key not in times:
            times[key] = [unit_seconds(ctx, u, o, batch, accum) for o in options[u]]
        out.append(bound.candidates(u, options[u], times[key]))
    out.append([Candidate(0.0, bound.global_transient(), 0.0)])
    return out


def unit_option_lists(ctx: Context, req: PlanRequest) -> dict[str, list[Option]]:
    """Every option of every unit the topology and the unit's shape allow."""
    return {u.name: unit_options(req.world_size, req.workers_per_node, req.nodes, _splittable(ctx, u.name),
                                 _checkpointable(ctx, u.name)) for u in ctx.profile.units}


def search_osdp(ctx: Context, req: PlanRequest) -> Choice | None:
    """Best throughput over the batch candidates; None if no plan fits at any batch."""
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    best: Choice | None = None
    for batch, accum in batch_candidates(req):
        cands = search_candidates(ctx, units, options, batch, accum)
        found = solve(cands, ctx.memory_limit)
        if found is None:
            if req.global_batch_size is None:
                break  # larger batches only need more memory
            continue
        chosen = {u: options[u][i] for u, i in zip(units, found.choice[:-1], strict=True)}
        ev = evaluate(ctx, chosen, batch, accum)
        if ev.peak_bytes > ctx.memory_limit:  # the bound is an upper bound of this; never trust it blindly
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(chosen, batch, accum, ev)
    # the search's bound is conservative: a uniform plan, or the smallest footprint, may fit when
    # simulated and beat it; OSDP never returns less than the best of them
    others = [best_uniform(ctx, req, s) for s in Strategy] + [smallest_footprint(ctx, req)]
    for other in others:
        if other is not None and other.evaluation.peak_bytes <= ctx.memory_limit and (
                best is None or other.evaluation.throughput > best.evaluation.throughput):
            best = other
    return best


def best_uniform(ctx: Context, req: PlanRequest, strategy: Strategy) -> Choice | None:
    """A uniform strategy at its best-throughput batch whose simulated peak fits."""
    opt = Option(strategy, group_size(strategy, req))
    options = {u.name: opt for u in ctx.profile.units}
    best: Choice | None = None
    for batch, accum in batch_candidates(req):
        ev = evaluate(ctx, options, batch, accum)
        if ev.peak_bytes > ctx.memory_limit:
            if req.global_batch_size is None:
                break
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(options, batch, accum, ev)
    return best


def smallest_footprint(ctx: Context, req: PlanRequest) -> Choice:
    """The least memory a plan needs, as far as the planner can tell, at the smallest batch: the plan
    that minimises the search's memory bound, or a uniform ZeRO-3 plan (every split factor, with and
    without checkpointing: splitting adds buffers, so more is not always less), whichever simulates lower."""
    batch, accum = min(batch_candidates(req))
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    cands = search_candidates(ctx, units, options, batch, accum)
    plans = [{u: options[u][i] for u, i in zip(units, least_bound(cands), strict=False)}]
    for split in SPLITS:
        for ckpt in (False, True):
            plans.append({u.name: Option(Strategy.ZERO3, req.world_size, split if _splittable(ctx, u.name) else 1,
                                         ckpt and _checkpointable(ctx, u.name)) for u in ctx.profile.units})
    evaluated = [Choice(p, batch, accum, evaluate(ctx, p, batch, accum)) for p in plans]
    return min(evaluated, key=lambda c: c.evaluation.peak_bytes)


def describe(options: dict[str, Option]) -> str:
    """A plan in a few words, for messages: strategies, splits, checkpointing."""
    kinds: dict[str, int] = {}
    for o in options.values():
        name = f"HSDP({o.group})" if o.strategy is Strategy.HSDP else o.strategy.value.upper().replace("ZERO", "ZeRO-")
        kinds[name] = kinds.get(name, 0) + 1
    words = [", ".join(f"{n} x{k}" for n, k in kinds.items())]
    splits = sorted({o.split for o in options.values()} - {1})
    words.append(f"Linears split {'/'.join(map(str, splits))} ways" if splits else "no split")
    ckpt = sum(o.checkpoint for o in options.values())
    words.append(f"{ckpt} unit(s) checkpointed" if ckpt else "no checkpointing")
    return "; ".join(words)


def baselines(ctx: Context, req: PlanRequest) -> dict[str, Baseline]:
    out = {}
    for strategy in Strategy:
        found = best_uniform(ctx, req, strategy)
        if found is None:
            out[strategy.value] = Baseline(fits=False)
        else:
            ev = found.evaluation
            out[strategy.value] = Baseline(fits=True, micro_batch_size=found.batch,
                                           peak_memory_bytes=int(ev.peak_bytes), step_time_s=ev.step_time_s,
                                           throughput_samples_per_s=ev.throughput)
    return out


def infeasible(ctx: Context, req: PlanRequest) -> UserError:
    low = smallest_footprint(ctx, req)
    need = low.evaluation.peak_bytes
    what = "no plan fits" if req.planner in ("osdp", "manual") else f"no {req.planner} plan fits at any batch size"
    advised = req.margin.budget_for(need) / GIB
    fix = (f"raise the memory limit to at least {advised:.4f} GiB (the footprint plus the "
           f"{req.margin.describe()} margin), add devices, or shorten data.seq_len")
    if req.planner not in ("osdp", "manual") and need <= ctx.memory_limit:
        fix = "use planner.name=osdp, which mixes strategies to fit, or raise the memory limit"
    return UserError(
        "planner.memory_limit_gb", round(req.memory_limit_bytes / GIB, 4),
        f"{what}: the smallest footprint the planner finds is {need / GIB:.4f} GiB per device "
        f"({describe(low.options)}; micro batch {low.batch}), and {ctx.memory_limit / GIB:.4f} GiB of the "
        f"budget is usable after the {req.margin.describe()} margin", fix)


def to_plan(model: nn.Module, req: PlanRequest, ctx: Context, choice: Choice) -> Plan:
    ev = choice.evaluation
    units = [
        UnitPlan(name=u.name, modules=list(u.modules), strategy=choice.options[u.name].strategy,
                 shard_group_size=choice.options[u.name].group, split=choice.options[u.name].split,
                 checkpoint=choice.options[u.name].checkpoint, param_count=u.param_count,
                 predicted_memory_bytes=int(ev.unit_resident[u.name]), predicted_time_s=ev.unit_time_s[u.name])
        for u in ctx.profile.units
    ]
    plan = make_plan(model, req, units, choice.batch, choice.accum)
    return plan.model_copy(update={
        "predicted": Predicted(peak_memory_bytes=int(ev.peak_bytes), step_time_s=ev.step_time_s,
                               throughput_samples_per_s=ev.throughput),
        "baselines": baselines(ctx, req),
    })
