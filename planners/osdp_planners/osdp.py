"""The OSDP search: per unit the fastest choice of strategy, shard group, split and checkpointing whose
memory fits, at the batch with the highest throughput (samples/s), not the shortest step, which would
always favour the smallest batch.

What it weighs besides its own finds: the uniform baselines (uniform.Baselines) and the least
footprint (advice.smallest_footprint), which may fit when simulated where the search's bound says not.
"""

import dataclasses
import math
import time

from osdp_planners.advice import smallest_footprint
from osdp_planners.batch_search import AUTO_MILP_BINARIES, CERTIFIED_GAP, Instance, candidates, search
from osdp_planners.choice import Choice, describe
from osdp_planners.evaluate import Context, evaluate
from osdp_planners.options import Option, runtime_preference
from osdp_planners.plan import Predicted, SearchReport
from osdp_planners.request import PlanRequest, search_mode
from osdp_planners.search import Candidate
from osdp_planners.space import batch_candidates, unit_option_lists
from osdp_planners.uniform import Baselines

# a plan the runtime works harder for (more sharding, more FSDP2 units, recomputation) is chosen over a
# simpler one only if predicted at least this much faster. On CPU gloo pools, predicted gaps of 3%
# (llama-tiny: DDP + ZeRO-2 over DDP) and 11% (a wide model: ZeRO-2 over DDP) measured the other way
# round (benchmarks/RESULTS.md, two runs); the step-time model errs by ~20% there, and a user who
# measures a harder plan losing to DDP trusts none of them
NEAR_TIE = 0.10


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
        if ev.peak_bytes > ctx.usable_memory_bytes:  # every search promises this; never trust them blindly
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(chosen, inst.batch, inst.accum, ev)
    return best, upper if bounded else None


def search_osdp(ctx: Context, req: PlanRequest, baselines: Baselines | None = None) -> Choice | None:
    """Best throughput over the batch candidates; None if no plan fits at any batch. `baselines`: the
    uniform plans of this context, where the caller keeps them for the plan's record."""
    started = time.perf_counter()
    mode = search_mode(req.search)
    units = [u.name for u in ctx.profile.units]
    options = unit_option_lists(ctx, req)
    best, upper = _search_batches(ctx, req, mode, units, options)
    # the knapsack's bound is conservative: a uniform plan, or the smallest footprint, may fit when
    # simulated and beat it
    others = [*(baselines or Baselines(ctx, req)).fitting(), smallest_footprint(ctx, req)]
    fitting = [c for c in [best, *others] if c is not None and c.evaluation.peak_bytes <= ctx.usable_memory_bytes]
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
