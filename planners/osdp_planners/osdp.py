"""The OSDP planner and the cost-model view of the uniform baselines.

For every candidate micro batch it finds the fastest per-unit choice of strategy, shard group, split
and checkpointing whose memory fits, then keeps the batch with the highest throughput (samples/s),
not the shortest step, which would always favour the smallest batch.
"""

import dataclasses
import json
import math
import time
from dataclasses import dataclass

from torch import nn

from osdp_planners.batch_search import (
    AUTO_MILP_BINARIES,
    AUTO_TIME_LIMIT_S,
    CERTIFIED_GAP,
    Instance,
    candidates,
    search,
    unit_costs,
)
from osdp_planners.errors import NoPlanFits
from osdp_planners.evaluate import Bound, Context, Evaluation, evaluate
from osdp_planners.explanation import Explanation, jsonable
from osdp_planners.milp import TIME_LIMIT_S, least_peak
from osdp_planners.options import SPLITS, Option, runtime_preference, unit_options
from osdp_planners.plan import Baseline, Plan, Predicted, SearchReport, Strategy, UnitPlan
from osdp_planners.request import PlanRequest, search_mode
from osdp_planners.search import Candidate, least_bound
from osdp_planners.uniform import group_size, make_plan
from osdp_planners.units import ROOT

MAX_MICRO_BATCH = 1024
GIB = 1024**3
# a plan the runtime works harder for (more sharding, more FSDP2 units, recomputation) is chosen over a
# simpler one only if predicted at least this much faster. On CPU gloo pools, predicted gaps of 3%
# (llama-tiny: DDP + ZeRO-2 over DDP) and 11% (a wide model: ZeRO-2 over DDP) measured the other way
# round (benchmarks/RESULTS.md, two runs); the step-time model errs by ~20% there, and a user who
# measures a harder plan losing to DDP trusts none of them
NEAR_TIE = 0.10


@dataclass(frozen=True)
class Choice:
    options: dict[str, Option]
    micro_batch_size: int
    grad_accum_steps: int
    evaluation: Evaluation
    report: SearchReport | None = None  # how the osdp search found it, and why it was chosen


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


def _splittable(ctx: Context, unit: str) -> bool:
    return bool(ctx.profile.linear_bytes[unit])


def _checkpointable(ctx: Context, unit: str) -> bool:
    return unit in ctx.profile.by_unit and unit != ROOT  # the root is the whole model


def _use_milp(mode: str, binaries: int) -> bool:
    return mode == "milp" or (mode == "auto" and binaries <= AUTO_MILP_BINARIES)


def _milp_time_limit(mode: str) -> float:
    return TIME_LIMIT_S if mode == "milp" else AUTO_TIME_LIMIT_S


def search_candidates(
    ctx: Context, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[list[Candidate]]:
    """The knapsack's instance at one batch (see batch_search.candidates)."""
    inst = Instance(ctx, units, options, batch, accum)
    return candidates(inst.bound, units, options, inst.costs)


def search_batch(
    ctx: Context, mode: str, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[int] | None:
    """The cheapest choice (an option index per unit) whose memory fits at one batch, or None
    (batch_search.search says how each mode searches)."""
    return search(Instance(ctx, units, options, batch, accum), search_mode(mode)).choice


def unit_option_lists(ctx: Context, req: PlanRequest) -> dict[str, list[Option]]:
    """Every option of every unit the topology and the unit's shape allow."""
    return {
        u.name: unit_options(
            req.world_size, req.workers_per_node, req.nodes, _splittable(ctx, u.name), _checkpointable(ctx, u.name)
        )
        for u in ctx.profile.units
    }


def _search_batches(
    ctx: Context, req: PlanRequest, mode: str, units: list[str], options: dict[str, list[Option]]
) -> tuple[Choice | None, float | None]:
    """The best plan of the search over the batch candidates, and the most samples/s any plan can
    reach (None: the knapsack bounds nothing). The bounded searches visit batches by their linear
    relaxation's bound, best first, and skip a batch whose bound cannot beat the plan in hand."""
    bounded = mode != "knapsack"
    instances = []
    for batch, accum in batch_candidates(req):
        inst = Instance(ctx, units, options, batch, accum)
        if bounded and inst.relaxed == math.inf:  # not even fractional choices fit
            if req.global_batch_size is None:
                break  # larger batches only need more memory
            continue
        instances.append(inst)
    if bounded:
        instances.sort(key=lambda i: -i.upper(i.relaxed))
    best: Choice | None = None
    upper = 0.0
    for inst in instances:
        gap = CERTIFIED_GAP if mode == "auto" and inst.binaries > AUTO_MILP_BINARIES else 0.0
        if bounded and best is not None and inst.upper(inst.relaxed) <= best.evaluation.throughput * (1 + gap):
            upper = max(upper, inst.upper(inst.relaxed))
            continue
        found = search(inst, mode)
        upper = max(upper, inst.upper(found.lower))
        if found.choice is None:
            if req.global_batch_size is None and not bounded:
                break
            continue
        chosen = {u: options[u][i] for u, i in zip(units, found.choice, strict=True)}
        ev = evaluate(ctx, chosen, inst.batch, inst.accum)
        if ev.peak_bytes > ctx.memory_limit:  # every search promises this; never trust them blindly
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(chosen, inst.batch, inst.accum, ev)
    return best, upper if bounded else None


def search_osdp(ctx: Context, req: PlanRequest) -> Choice | None:
    """Best throughput over the batch candidates; None if no plan fits at any batch."""
    started = time.perf_counter()
    mode = search_mode(req.search)
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    best, upper = _search_batches(ctx, req, mode, units, options)
    # the knapsack's bound is conservative: a uniform plan, or the smallest footprint, may fit when
    # simulated and beat it
    others = [best_uniform(ctx, req, s) for s in Strategy] + [smallest_footprint(ctx, req)]
    fitting = [c for c in [best, *others] if c is not None and c.evaluation.peak_bytes <= ctx.memory_limit]
    if not fitting:
        return None
    fastest = max(fitting, key=lambda c: c.evaluation.throughput)
    chosen = prefer_simpler(fitting) if req.prefer_simpler else fastest
    report = search_report(mode, time.perf_counter() - started, upper, fastest, chosen, req.prefer_simpler)
    return dataclasses.replace(chosen, report=report)


def search_report(
    mode: str, seconds: float, upper: float | None, fastest: Choice, chosen: Choice, simpler: bool
) -> SearchReport:
    """What the search proved and what the near-tie rule gave up, for the plan and its printout."""
    best, got = fastest.evaluation.throughput, chosen.evaluation.throughput
    bounded = upper if upper is not None and 0 < upper < math.inf else None  # inf: a solve stopped unbounded
    if chosen is fastest or got >= best:
        why = "the fastest plan found"
    else:
        why = (
            f"prefer_simpler: the simplest plan for the runtime predicted within {NEAR_TIE:.0%} of the fastest "
            f"(osdp.NEAR_TIE; planner.prefer_simpler=false keeps the fastest)"
        )
    return SearchReport(
        mode=mode,
        seconds=seconds,
        throughput_upper_bound=bounded,
        optimality_gap=None if bounded is None else max(0.0, 1 - best / bounded),
        best=Predicted(
            peak_memory_bytes=int(fastest.evaluation.peak_bytes),
            step_time_s=fastest.evaluation.step_time_s,
            throughput_samples_per_s=best,
        ),
        best_plan=f"{describe(fastest.options)}; micro batch {fastest.micro_batch_size}",
        chosen_by=why,
        prefer_simpler=simpler,
        near_tie=NEAR_TIE,
        simplicity_cost=max(0.0, 1 - got / best),
    )


def simplicity(choice: Choice) -> tuple[int, int, bool]:
    """How hard the runtime works for a plan: its costliest unit's kind in runtime_preference (a mixed
    plan of DP and ZeRO-2 units is run like ZeRO-2, plus a second set of process groups)."""
    return max(runtime_preference(o) for o in choice.options.values())


def prefer_simpler(choices: list[Choice]) -> Choice:
    """The simplest plan predicted within NEAR_TIE of the fastest, the faster of equally simple ones."""
    fastest = max(c.evaluation.throughput for c in choices)
    near = [c for c in choices if c.evaluation.throughput * (1 + NEAR_TIE) >= fastest]
    return min(near, key=lambda c: (simplicity(c), -c.evaluation.throughput))


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
    with the least simulated peak where the exact program runs (see search_batch), the plan that
    minimises the search's memory bound, or a uniform ZeRO-3 plan (every split factor, with and
    without checkpointing: splitting adds buffers, so more is not always less), whichever simulates lower."""
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
                        split if _splittable(ctx, u.name) else 1,
                        ckpt and _checkpointable(ctx, u.name),
                    )
                    for u in ctx.profile.units
                }
            )
    evaluated = [Choice(p, batch, accum, evaluate(ctx, p, batch, accum)) for p in plans]
    return min(evaluated, key=lambda c: c.evaluation.peak_bytes)


def describe(options: dict[str, Option]) -> str:
    """A plan in a few words, for messages: strategies, splits, checkpointing."""
    kinds: dict[str, int] = {}
    for o in options.values():
        name = (
            f"HSDP({o.shard_group_size})"
            if o.strategy is Strategy.HSDP
            else o.strategy.value.upper().replace("ZERO", "ZeRO-")
        )
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
            out[strategy.value] = Baseline(
                fits=True,
                micro_batch_size=found.micro_batch_size,
                peak_memory_bytes=int(ev.peak_bytes),
                step_time_s=ev.step_time_s,
                throughput_samples_per_s=ev.throughput,
            )
    return out


def uniform_footprint(ctx: Context, req: PlanRequest, strategy: Strategy) -> Choice:
    """The least memory a uniform plan of `strategy` needs: at the smallest batch, as best_uniform plans it."""
    options = {u.name: Option(strategy, group_size(strategy, req)) for u in ctx.profile.units}
    batch, accum = min(batch_candidates(req))
    return Choice(options, batch, accum, evaluate(ctx, options, batch, accum))


def infeasible(ctx: Context, req: PlanRequest) -> NoPlanFits:
    """Why nothing fits, with the least budget that would fit a plan of this planner."""
    uniform = req.planner not in ("osdp", "manual")
    low = uniform_footprint(ctx, req, Strategy(req.planner)) if uniform else smallest_footprint(ctx, req)
    need = low.evaluation.peak_bytes
    what = f"no {req.planner} plan fits at any batch size" if uniform else "no plan fits"
    advised = req.margin.budget_for(need) / GIB
    fix = (
        f"raise {req.budget_key} to at least {advised:.4f} GiB (the footprint plus the "
        f"{req.margin.describe()} margin), add devices, or shorten data.seq_len"
    )
    if uniform:
        mixed = req.margin.budget_for(smallest_footprint(ctx, req).evaluation.peak_bytes) / GIB
        fix += f"; or use planner.name=osdp, which mixes strategies and fits from {mixed:.4f} GiB"
    return NoPlanFits(
        req.budget_key,
        round(req.memory_limit_bytes / GIB, 4),
        f"{what}: the smallest footprint the planner finds is {need / GIB:.4f} GiB per device "
        f"({describe(low.options)}; micro batch {low.micro_batch_size}), and {ctx.memory_limit / GIB:.4f} GiB of the "
        f"budget is usable after the {req.margin.describe()} margin",
        fix,
        advised,
    )


def _times_from(ctx: Context) -> str:
    """Planned offline (no device to time on), the plan says its times are the preset's."""
    if ctx.measured is not None:
        return "measured"
    device = ctx.topo.device
    return f"preset {device.name}: FLOPs at {device.flops_per_s / 1e12:g} TFLOP/s sustained"


def to_plan(model: nn.Module, req: PlanRequest, ctx: Context, choice: Choice) -> Plan:
    ev = choice.evaluation
    units = [
        UnitPlan(
            name=u.name,
            modules=list(u.modules),
            strategy=choice.options[u.name].strategy,
            shard_group_size=choice.options[u.name].shard_group_size,
            split=choice.options[u.name].split,
            checkpoint=choice.options[u.name].checkpoint,
            param_count=u.param_count,
            predicted_memory_bytes=int(ev.unit_resident[u.name]),
            predicted_time_s=ev.unit_seconds[u.name].total_s,
        )
        for u in ctx.profile.units
    ]
    plan = make_plan(model, req, units, choice.micro_batch_size, choice.grad_accum_steps)
    return plan.model_copy(
        update={
            "predicted": Predicted(
                peak_memory_bytes=int(ev.peak_bytes),
                reserved_memory_bytes=int(req.margin.reserved(ev.peak_bytes)),
                step_time_s=ev.step_time_s,
                throughput_samples_per_s=ev.throughput,
                times_from=_times_from(ctx),
            ),
            "baselines": baselines(ctx, req),
            "search": choice.report,
        }
    )


def explain(ctx: Context, choice: Choice) -> Explanation:
    """The cost model's account of `choice`, as plain data for the platform's charts and artifacts."""
    ev = choice.evaluation
    computed_from = {
        "profile": jsonable(ctx.profile),
        "measured_compute": jsonable(ctx.measured),
        "measured_comm": jsonable(ctx.topo.measured),
        "device": jsonable(ctx.topo.device),
    }
    return Explanation(
        timeline=list(ev.timeline.events),
        units=dict(ev.unit_seconds),
        fixed_s=choice.grad_accum_steps * ctx.topo.step_fixed_s,
        computed_from=json.dumps(computed_from, indent=1, default=str),
    )
