"""One micro batch's search: what each option costs, and the cheapest choice whose memory fits.

Three ways to search (`planner.search`):
- knapsack: the multiple-choice knapsack over a decomposable upper bound of the peak (search.py):
  milliseconds at any size, never over the limit, but it misses plans the bound over-states;
- milp: the exact program over the simulated peak (milp.py), solved to optimality (or its time
  limit), the knapsack only where it returns nothing;
- auto (default): certified. Options another one of its unit beats on time and on memory at every
  event are dropped (dominance.py, exact); the linear relaxation of the program bounds every plan's
  cost from below (and proves that nothing fits where it is infeasible); the plan that keeps what the
  relaxation decided (relax_and_fix.py) is kept where it meets that bound, then the knapsack's, and
  otherwise HiGHS solves the whole program until its plan is proven within CERTIFIED_GAP of the
  optimum, or exactly where the program is small (AUTO_MILP_BINARIES).
Every answer carries the bound, so the planner can print the gap it proved.
"""

import math
from dataclasses import dataclass
from functools import cached_property

from osdp_planners.dominance import prune
from osdp_planners.evaluate import Bound, Context, unit_seconds
from osdp_planners.milp import TIME_LIMIT_S, Exact, Program, Relaxation, build_program, relaxation, solve_exact
from osdp_planners.options import Option, runtime_preference
from osdp_planners.relax_and_fix import fix_and_solve
from osdp_planners.search import Candidate, solve

TIE_BREAK = 1e-8
# auto solves the program exactly up to this many binaries (units x undominated options): measured on
# Llama-tiny stacks, HiGHS proves the optimum within a second up to ~1,600 binaries
AUTO_MILP_BINARIES = 1100
AUTO_TIME_LIMIT_S = 5.0  # per micro batch; the best plan found by then is used, with the bound proved by then
# auto's target beyond AUTO_MILP_BINARIES: the plan is proven at most this share slower than the optimum
CERTIFIED_GAP = 0.005


def _time_key(ctx: Context, bound: Bound, unit: str) -> tuple[object, ...]:
    """What a unit's step times depend on: identical blocks share them instead of rescoring."""
    measured = None if ctx.measured is None else (ctx.measured.forward.get(unit), ctx.measured.backward.get(unit))
    flops = tuple(m.fwd_flops for m in ctx.profile.by_unit.get(unit, []))
    return bound.signature(unit), ctx.profile.tensor_count[unit], measured, flops


def tie_broken(options: list[Option], times: list[float]) -> list[float]:
    """A unit's step seconds per option plus TIE_BREAK of its slowest per rank in runtime_preference:
    options the time model prices the same (DP and HSDP over groups of one, often) resolve to the
    one the runtime executes fastest, in every search; real differences are far larger."""
    step = TIE_BREAK * max(times, default=0.0)
    order = sorted(range(len(options)), key=lambda i: runtime_preference(options[i]))
    costs = list(times)
    for rank, i in enumerate(order):
        costs[i] += rank * step
    return costs


def unit_costs(
    ctx: Context, bound: Bound, units: list[str], options: dict[str, list[Option]], batch: int, accum: int
) -> list[list[float]]:
    """What every search minimises, per unit and option: evaluate()'s step time is their sum (without
    the tie-break) plus the plan-independent fixed cost."""
    times: dict[tuple[object, ...], list[float]] = {}
    out = []
    for u in units:
        key = (_time_key(ctx, bound, u), tuple(options[u]))
        if key not in times:
            times[key] = tie_broken(options[u], [unit_seconds(ctx, u, o, batch, accum) for o in options[u]])
        out.append(times[key])
    return out


def candidates(
    bound: Bound, units: list[str], options: dict[str, list[Option]], costs: list[list[float]]
) -> list[list[Candidate]]:
    """Every unit's candidates for the knapsack, plus one for the loss and optimizer step's base."""
    out = [bound.candidates(u, options[u], c) for u, c in zip(units, costs, strict=True)]
    out.append([Candidate(0.0, bound.global_transient(), 0.0)])
    return out


@dataclass(frozen=True)
class Found:
    choice: list[int] | None  # an option index per unit; None: no plan found
    cost: float  # its cost (inf where none)
    lower: float  # no plan that fits at this batch costs less (inf: none fits; -inf: not bounded)


class Instance:
    """One micro batch's problem: the units' options, their costs and the memory view."""

    def __init__(self, ctx: Context, units: list[str], options: dict[str, list[Option]], batch: int, accum: int):
        self.ctx, self.units, self.options, self.batch, self.accum = ctx, units, options, batch, accum
        self.bound = Bound(ctx, batch, accum)
        self.bound.add_neighbour_buffers(options)
        self.costs = unit_costs(ctx, self.bound, units, options, batch, accum)

    @property
    def samples(self) -> int:
        return self.batch * self.accum * self.ctx.topo.world_size

    def throughput(self, cost: float) -> float:
        """Samples/s of a plan of this cost (evaluate()'s, up to the tie-break)."""
        return self.samples / (cost + self.accum * self.ctx.topo.step_fixed_s)

    def upper(self, lower: float) -> float:
        """The most samples/s any plan costing at least `lower` can reach (the tie-break taken off)."""
        if math.isinf(lower):
            return 0.0 if lower > 0 else math.inf
        slack = sum(TIE_BREAK * max(c) * (len(c) - 1) for c in self.costs)
        return self.throughput(max(lower - slack, 0.0))

    @cached_property
    def pruned(self) -> tuple[dict[str, list[Option]], list[list[float]], list[list[int]]]:
        """The undominated options per unit, their costs, and their indices into the full lists."""
        kept = prune(self.bound, self.units, self.options, self.costs)
        options = {u: [self.options[u][i] for i in k] for u, k in zip(self.units, kept, strict=True)}
        costs = [[c[i] for i in k] for c, k in zip(self.costs, kept, strict=True)]
        return options, costs, kept

    @cached_property
    def program(self) -> Program:
        """The exact program over the undominated options, built once for the relaxation and the solve."""
        options, costs, _ = self.pruned
        return build_program(self.bound, self.units, options, costs)

    @cached_property
    def relaxation(self) -> Relaxation:
        options, costs, _ = self.pruned
        return relaxation(self.bound, self.units, options, costs, self.ctx.usable_memory_bytes, self.program)

    @property
    def relaxed(self) -> float:
        """The linear relaxation's least cost (inf where not even fractional choices fit, -inf where HiGHS
        ran out of time)."""
        return self.relaxation.lower

    def knapsack(self) -> Found:
        found = solve(candidates(self.bound, self.units, self.options, self.costs), self.ctx.usable_memory_bytes)
        if found is None:
            return Found(None, math.inf, -math.inf)
        return Found(found.choice[:-1], found.time_s, -math.inf)

    def exact(self, time_limit: float, rel_gap: float) -> Found:
        """The program over the undominated options; indices mapped back to the full lists."""
        options, costs, _ = self.pruned
        limit = self.ctx.usable_memory_bytes
        found = solve_exact(self.bound, self.units, options, costs, limit, time_limit, rel_gap, self.program)
        return self._found(found, found.lower if found else -math.inf)

    def fixed(self, time_limit: float) -> Found:
        """The plan that keeps every unit the relaxation decided (relax_and_fix.py), bounded by the relaxation."""
        options, costs, _ = self.pruned
        limit = self.ctx.usable_memory_bytes
        found = fix_and_solve(self.bound, self.units, options, costs, limit, self.program, self.relaxation, time_limit)
        return self._found(found, self.relaxed)

    def _found(self, exact: Exact | None, lower: float) -> Found:
        """A solve's plan with its indices mapped back to the full option lists."""
        if exact is None:
            return Found(None, math.inf, lower)
        kept = self.pruned[2]
        return Found([k[i] for k, i in zip(kept, exact.choice, strict=True)], exact.cost, lower)

    @property
    def binaries(self) -> int:
        return sum(len(k) for k in self.pruned[2])


def _better(a: Found, b: Found) -> Found:
    best = a if a.cost <= b.cost else b
    return Found(best.choice, best.cost, max(a.lower, b.lower))


def search(inst: Instance, mode: str) -> Found:
    """The cheapest choice whose memory fits at one batch, by `mode` (see the module docstring)."""
    if mode == "knapsack":
        return inst.knapsack()
    if mode == "milp":
        found = inst.exact(TIME_LIMIT_S, 0.0)
        return found if found.choice is not None else _better(found, inst.knapsack())
    lower = inst.relaxed
    if lower == math.inf:  # proven: nothing fits
        return Found(None, math.inf, lower)
    gap = 0.0 if inst.binaries <= AUTO_MILP_BINARIES else CERTIFIED_GAP
    found = inst.fixed(AUTO_TIME_LIMIT_S)
    if found.cost > lower * (1 + gap):
        found = _better(found, inst.knapsack())
    if found.cost > lower * (1 + gap):
        found = _better(found, inst.exact(AUTO_TIME_LIMIT_S, gap))
    return found
