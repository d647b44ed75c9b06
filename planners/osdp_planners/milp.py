"""Exact search over the simulated peak: a mixed-integer program over one-hot option choices.

The knapsack (search.py) fits a decomposable upper bound of the peak, so near the limit it rejects
plans that fit. Here the constraint is the simulation itself: the bytes at every event are the
option-independent base plus, for every unit, what its chosen option holds there
(memory_model.unit_segments, the ranges `simulate` adds up), linear in binaries x[u, o] with
sum_o x[u, o] = 1. The objective is the per-unit cost the knapsack minimises (step seconds plus the
tie-break), whose sum plus a plan-independent constant is evaluate()'s step time.

Size: a unit's option holds a few ranges of events, so the level is written as a chain over runs
of events where no range starts or ends (all events of a run have the same unit terms; the run's
row is checked against its highest base): L_k = L_{k-1} + what starts at run k - what ended just
before it, L_k <= limit - base. Two nonzeros per range, so the program grows linearly with the
model, and identical units share their footprints (Bound.footprint). Bytes are scaled by the limit
and seconds so that the plan's time is about OBJECTIVE_SCALE: HiGHS's absolute gap (1e-6) is then
far below the tie-break.
"""

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from osdp_planners.evaluate import Bound
from osdp_planners.memory_model import simulate, unit_segments
from osdp_planners.options import Option

TIME_LIMIT_S = 20.0  # per micro batch; the best plan found by then is used, even if not proven optimal
OBJECTIVE_SCALE = 1e6
PEAK_TIE = 1e-8  # weight of the cost when the peak is minimised: only a tie-break between equal peaks
INFEASIBLE = 2  # scipy.optimize.milp's status for a program proven to have no solution
OTHER = 4  # its status where HiGHS's presolve answered "Not Set": seen on infeasible relaxations (70B, 16 GPUs)
ROUNDING_RETRIES = 3  # re-solves with a limit lowered by HiGHS's feasibility error, should rounding break it


@dataclass(frozen=True)
class Exact:
    choice: list[int]  # per unit, an index into its options
    cost: float  # sum of the chosen costs
    lower: float  # HiGHS's proven bound: no plan under the limit costs less


@dataclass(frozen=True)
class Program:
    """The MILP's arrays for one micro batch, before the limit is applied."""

    cost: np.ndarray  # per binary
    owner: np.ndarray  # per binary, its unit's index
    option: np.ndarray  # per binary, the index into its unit's options
    deltas: coo_array  # runs x binaries: bytes that start (+) or end (-) at each run
    run_base: np.ndarray  # per run, the highest base level among its events

    def restricted(self, keep: np.ndarray) -> "Program":
        """The same program over the binaries `keep` marks (a mask): the others are fixed at zero."""
        cols = np.flatnonzero(keep)
        return Program(
            self.cost[cols], self.owner[cols], self.option[cols], self.deltas.tocsc()[:, cols].tocoo(), self.run_base
        )


@dataclass(frozen=True)
class Relaxation:
    """The linear relaxation's optimum: fractional choices x (None where there is none) and their cost, a
    lower bound on every plan's (inf: not even fractional choices fit; -inf: HiGHS stopped first)."""

    x: np.ndarray | None
    lower: float


def build_program(
    bound: Bound, units: list[str], options: dict[str, list[Option]], costs: list[list[float]]
) -> Program:
    ctx = bound.ctx
    layout = ctx.layout
    n_events = len(layout.events)
    owner: list[int] = []
    option: list[int] = []
    cost: list[float] = []
    cols, events, values = [], [], []
    for j, u in enumerate(units):
        for i, o in enumerate(options[u]):
            col = len(cost)
            owner.append(j)
            option.append(i)
            cost.append(costs[j][i])
            fp = bound.footprint(u, o) if u in layout.units else None
            for a, z, value in unit_segments(ctx.profile, layout, u, o, bound.settings, fp):
                if a > z or not value:
                    continue
                cols.append(col)
                events.append(a)
                values.append(value)
                if z + 1 < n_events:
                    cols.append(col)
                    events.append(z + 1)
                    values.append(-value)
    starts = np.unique(np.concatenate([[0], np.asarray(events, dtype=np.int64)]))
    runs = np.searchsorted(starts, np.asarray(events, dtype=np.int64))
    deltas = coo_array(
        (np.asarray(values, dtype=float), (runs, np.asarray(cols, dtype=np.int64))), shape=(len(starts), len(cost))
    )
    deltas.sum_duplicates()
    return Program(
        np.asarray(cost), np.asarray(owner), np.asarray(option), deltas, np.maximum.reduceat(bound.base, starts)
    )


def _solve(
    p: Program,
    n_units: int,
    limit: float | None,
    time_limit: float,
    scale: float,
    rel_gap: float = 0.0,
    relaxed: bool = False,
) -> tuple[np.ndarray | None, float]:
    """Binaries of the best plan HiGHS finds (optimal unless the time limit stops it): the least cost with
    every run's level <= limit, or (limit None) the least peak, its cost breaking ties; with the
    least cost HiGHS proved no plan beats. Relaxed: the linear program (fractional choices), whose
    optimum bounds every plan's cost from below in a fraction of the time. Without a plan (None), the
    bound is inf where HiGHS proved that none exists, -inf where it stopped first."""
    n, k = len(p.cost), len(p.run_base)
    runs = np.arange(k)
    rows = [p.deltas.row, runs, runs[1:], k + p.owner]
    cols = [p.deltas.col, n + runs, n + runs[:-1], np.arange(n)]
    vals = [-p.deltas.data / scale, np.ones(k), -np.ones(k - 1), np.ones(n)]
    lower_rows = [np.zeros(k), np.ones(n_units)]
    upper_rows = [np.zeros(k), np.ones(n_units)]
    fastest = np.full(n_units, np.inf)
    np.minimum.at(fastest, p.owner, p.cost)
    seconds = OBJECTIVE_SCALE / max(float(fastest.sum()), 1e-30)
    levels_upper = (limit - p.run_base) / scale if limit is not None else np.full(k, np.inf)
    c: list[npt.ArrayLike] = [p.cost * seconds, np.zeros(k)]
    extra = 0
    if limit is None:  # one more variable, the peak: every run's level plus its base is at most it
        extra = 1
        rows.append(np.concatenate([k + n_units + runs, k + n_units + runs]))
        cols.append(np.concatenate([n + runs, np.full(k, n + k)]))
        vals.append(np.concatenate([np.ones(k), -np.ones(k)]))
        lower_rows.append(np.full(k, -np.inf))
        upper_rows.append(-p.run_base / scale)
        c = [p.cost * seconds * PEAK_TIE, np.zeros(k), [OBJECTIVE_SCALE]]
    a = coo_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(k + n_units + extra * k, n + k + extra),
    ).tocsr()
    lower = np.concatenate([np.zeros(n), np.full(k + extra, -np.inf)])
    upper = np.concatenate([np.ones(n), levels_upper, np.full(extra, np.inf)])
    # HiGHS's presolve has declared feasible programs infeasible, and left infeasible ones unanswered: ask
    # again; infeasible without presolve, or with it and unanswered without (as a relaxation at 8 sequences
    # of the 8-layer test model was), is infeasible
    said_infeasible = False
    for presolve in (True, False):
        res = milp(
            np.concatenate(c),
            integrality=np.concatenate([np.full(n, 0 if relaxed else 1), np.zeros(k + extra)]),
            bounds=Bounds(lower, upper),
            constraints=LinearConstraint(a, np.concatenate(lower_rows), np.concatenate(upper_rows)),
            options={"time_limit": time_limit, "mip_rel_gap": rel_gap, "presolve": presolve},
        )
        if res.status not in (INFEASIBLE, OTHER):
            break
        said_infeasible |= res.status == INFEASIBLE
    if res.x is None:  # proven infeasible (status 2), or stopped before finding a solution
        return None, np.inf if res.status == INFEASIBLE or (res.status == OTHER and said_infeasible) else -np.inf
    dual = res.fun if relaxed else res.get("mip_dual_bound")
    return res.x[:n], (-np.inf if dual is None else float(dual) / seconds)


def _choice(p: Program, x: np.ndarray, n_units: int) -> list[int]:
    choice = [0] * n_units
    for col in np.flatnonzero(x > 0.5):
        choice[p.owner[col]] = int(p.option[col])
    return choice


def least_peak(
    bound: Bound,
    units: list[str],
    options: dict[str, list[Option]],
    costs: list[list[float]],
    time_limit: float = TIME_LIMIT_S,
) -> list[int] | None:
    """The choice with the smallest simulated peak (the cheapest among equal peaks): the least memory
    any plan needs at this batch; None if HiGHS finds nothing in the time limit."""
    program = build_program(bound, units, options, costs)
    x, _ = _solve(program, len(units), None, time_limit, float(max(program.run_base.max(), 1.0)))
    return None if x is None else _choice(program, x, len(units))


def relaxation(
    bound: Bound,
    units: list[str],
    options: dict[str, list[Option]],
    costs: list[list[float]],
    limit: float,
    program: Program | None = None,
) -> Relaxation:
    """The linear relaxation under `limit`: its optimum bounds the cost of every plan whose simulated peak
    is at most `limit` from below (inf: then no plan fits). `program`: build_program's for these
    arguments, where the caller has it."""
    program = program or build_program(bound, units, options, costs)
    return Relaxation(*_solve(program, len(units), limit, TIME_LIMIT_S, limit, relaxed=True))


def solve_exact(
    bound: Bound,
    units: list[str],
    options: dict[str, list[Option]],
    costs: list[list[float]],
    limit: float,
    time_limit: float = TIME_LIMIT_S,
    rel_gap: float = 0.0,
    program: Program | None = None,
) -> Exact | None:
    """The least-cost plan whose simulated peak is at most `limit` (or one proven within `rel_gap` of
    it); None if none exists (or none was found within the time limit). `program` as in relaxation."""
    started = time.perf_counter()
    program = program or build_program(bound, units, options, costs)
    ctx, s = bound.ctx, bound.settings
    target = limit
    for _ in range(ROUNDING_RETRIES):
        left = max(time_limit - (time.perf_counter() - started), 0.1)
        x, lower = _solve(program, len(units), target, left, limit, rel_gap)
        if x is None:
            return None
        choice = _choice(program, x, len(units))
        chosen = {u: options[u][i] for u, i in zip(units, choice, strict=True)}
        peak = simulate(
            ctx.profile,
            chosen,
            s.micro_batch_size,
            ctx.compute_bytes,
            ctx.optimizer,
            s.grad_accum_steps,
            ctx.overlap,
            ctx.alone,
        ).peak
        if peak <= limit:
            total = sum(costs[j][i] for j, i in enumerate(choice))
            return Exact(choice, total, min(lower, total))
        target -= peak - limit + 1e-9 * limit
    return None
