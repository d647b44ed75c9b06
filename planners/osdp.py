"""The OSDP planner and the cost-model view of the uniform baselines.

For every candidate micro batch it finds the fastest per-unit choice of strategy, shard group, split
and checkpointing whose memory fits, then keeps the batch with the highest throughput (samples/s),
not the shortest step, which would always favour the smallest batch.
"""

from dataclasses import dataclass

from torch import nn

from osdp_planners.errors import NoPlanFits
from osdp_planners.evaluate import Bound, Context, Evaluation, evaluate, unit_seconds
from osdp_planners.milp import TIME_LIMIT_S, least_peak, solve_exact
from osdp_planners.options import SPLITS, Option, runtime_preference, unit_options
from osdp_planners.plan import Baseline, Plan, Predicted, Strategy, UnitPlan
from osdp_planners.request import PlanRequest
from osdp_planners.search import Candidate, least_bound, solve
from osdp_planners.uniform import group_size, make_plan
from osdp_planners.units import ROOT

MAX_MICRO_BATCH = 1024
TIE_BREAK = 1e-8
# auto runs the exact program up to this many binaries (units x options): measured on Llama-tiny stacks, HiGHS
# proves the optimum within a second up to ~1,600 binaries, and at 2,000-4,000 can run past a minute
AUTO_MILP_BINARIES = 1100
AUTO_TIME_LIMIT_S = 5.0
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


def _time_key(ctx: Context, bound: Bound, unit: str) -> tuple[object, ...]:
    """What a unit's step times depend on: identical blocks share them instead of rescoring."""
    measured = None if ctx.measured is None else (ctx.measured.forward.get(unit), ctx.measured.backward.get(unit))
    flops = tuple(m.fwd_flops for m in ctx.profile.by_unit.get(unit, []))
    return bound.signature(unit), ctx.profile.tensor_count[unit], measured, flops


def tie_broken(options: list[Option], times: list[float]) -> list[float]:
    """A unit's step seconds per option plus TIE_BREAK of its slowest per rank in runtime_preference:
    options the time model prices the same (DP and HSDP over groups of one, often) resolve to the
    one the runtime executes fastest, in both searches; real differences are far larger."""
    step = TIE_BREAK * max(times, default=0.0)
    order = sorted(range(len(options)), key=lambda i: runtime_preference(options[i]))
    costs = list(times)
    for rank, i in enumerate(order):
        costs[i] += rank * step
    return costs


def unit_costs(
    ctx: Context, bound: Bound, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[list[float]]:
    """What both searches minimise, per unit and option: evaluate()'s step time is their sum (without
    the tie-break) plus the plan-independent fixed cost."""
    times: dict[tuple[object, ...], list[float]] = {}
    out = []
    for u in units:
        key = (_time_key(ctx, bound, u), tuple(options[u]))
        if key not in times:
            times[key] = tie_broken(options[u], [unit_seconds(ctx, u, o, batch, accum) for o in options[u]])
        out.append(times[key])
    return out


def _candidates(
    bound: Bound, units: list[str], options: dict[str, list[Option]], costs: list[list[float]]
) -> list[list[Candidate]]:
    """Every unit's candidates for the knapsack, plus one for the loss and optimizer step's base."""
    out = [bound.candidates(u, options[u], c) for u, c in zip(units, costs, strict=True)]
    out.append([Candidate(0.0, bound.global_transient(), 0.0)])
    return out


def search_candidates(
    ctx: Context, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[list[Candidate]]:
    """The knapsack's instance at one batch (see _candidates)."""
    bound = Bound(ctx, batch, accum)
    bound.add_neighbour_buffers(options)
    return _candidates(bound, units, options, unit_costs(ctx, bound, units, options, batch, accum))


def _use_milp(mode: str, binaries: int) -> bool:
    return mode == "milp" or (mode == "auto" and binaries <= AUTO_MILP_BINARIES)


def _milp_time_limit(mode: str) -> float:
    return TIME_LIMIT_S if mode == "milp" else AUTO_TIME_LIMIT_S


def search_batch(
    ctx: Context, mode: str, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[int] | None:
    """The cheapest choice (an option index per unit) whose memory fits at one batch, or None.

    dp: the knapsack over the memory bound (milliseconds at any size, never over the limit, but it
    misses plans the bound over-states). milp: the exact program over the simulated peak (milp.py);
    the knapsack only where it returns nothing in its time limit. auto: the knapsack, then the
    program where the knapsack's plan is not already the fastest of all (a certificate: it cannot be
    beaten) and the program is small enough to solve in about a second (AUTO_MILP_BINARIES,
    measured), keeping the cheaper of the two.
    """
    bound = Bound(ctx, batch, accum)
    bound.add_neighbour_buffers(options)
    costs = unit_costs(ctx, bound, units, options, batch, accum)

    def knapsack() -> tuple[float, list[int]] | None:
        found = solve(_candidates(bound, units, options, costs), ctx.memory_limit)
        return None if found is None else (found.time_s, found.choice[:-1])

    best = None if mode == "milp" else knapsack()
    fastest = sum(min(c) for c in costs)
    if not _use_milp(mode, sum(len(options[u]) for u in units)) or (best is not None and best[0] <= fastest):
        return None if best is None else best[1]
    exact = solve_exact(bound, units, options, costs, ctx.memory_limit, _milp_time_limit(mode))
    if exact is not None and (best is None or exact.cost < best[0]):
        best = (exact.cost, exact.choice)
    if best is None and mode == "milp":
        best = knapsack()
    return None if best is None else best[1]


def unit_option_lists(ctx: Context, req: PlanRequest) -> dict[str, list[Option]]:
    """Every option of every unit the topology and the unit's shape allow."""
    return {
        u.name: unit_options(
            req.world_size, req.workers_per_node, req.nodes, _splittable(ctx, u.name), _checkpointable(ctx, u.name)
        )
        for u in ctx.profile.units
    }


def search_osdp(ctx: Context, req: PlanRequest) -> Choice | None:
    """Best throughput over the batch candidates; None if no plan fits at any batch."""
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    best: Choice | None = None
    for batch, accum in batch_candidates(req):
        found = search_batch(ctx, req.search, units, options, batch, accum)
        if found is None:
            if req.global_batch_size is None:
                break  # larger batches only need more memory
            continue
        chosen = {u: options[u][i] for u, i in zip(units, found, strict=True)}
        ev = evaluate(ctx, chosen, batch, accum)
        if ev.peak_bytes > ctx.memory_limit:  # both searches promise this; never trust them blindly
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(chosen, batch, accum, ev)
    # the search's bound is conservative: a uniform plan, or the smallest footprint, may fit when
    # simulated and beat it
    others = [best_uniform(ctx, req, s) for s in Strategy] + [smallest_footprint(ctx, req)]
    fitting = [c for c in [best, *others] if c is not None and c.evaluation.peak_bytes <= ctx.memory_limit]
    return prefer_simpler(fitting) if fitting else None


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
    choices = [least_bound(_candidates(bound, units, options, costs))]
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
            predicted_time_s=ev.unit_time_s[u.name],
        )
        for u in ctx.profile.units
    ]
    plan = make_plan(model, req, units, choice.micro_batch_size, choice.grad_accum_steps)
    return plan.model_copy(
        update={
            "predicted": Predicted(
                peak_memory_bytes=int(ev.peak_bytes),
                step_time_s=ev.step_time_s,
                throughput_samples_per_s=ev.throughput,
                times_from=_times_from(ctx),
            ),
            "baselines": baselines(ctx, req),
        }
    )
