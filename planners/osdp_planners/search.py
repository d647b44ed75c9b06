"""Exact search: the fastest choice of one option per unit whose memory bound fits the budget.

The bound is decomposable: the sum over units of what each keeps resident, plus the largest
transient of any chosen option (what is alive only while its unit runs). For each distinct
transient cap T the problem is a multiple-choice knapsack (resident bytes -> time); dynamic
programming over bytes in steps of `quantum` (weights rounded up, so every answer fits) solves it
exactly, and the best over all caps is the optimum of the bound.
"""

import math
from dataclasses import dataclass

import numpy as np

BUCKETS = 8192


@dataclass(frozen=True)
class Candidate:
    resident: float  # bytes kept for the whole step (states, retained activations or grads, held params)
    transient: float  # bytes alive only while this unit runs (gathers, unsharded grads, buffers)
    time_s: float


@dataclass(frozen=True)
class Solution:
    choice: list[int]  # index into each unit's candidates
    time_s: float
    bound_bytes: float
    cap: float


def quantum_for(budget: float) -> float:
    return max(budget / BUCKETS, 1.0)


def _allowed(cands: list[list[Candidate]], cap: float) -> list[list[int]]:
    return [[i for i, c in enumerate(unit) if c.transient <= cap] for unit in cands]


def bound(cands: list[list[Candidate]], choice: list[int], quantum: float) -> float:
    """The search's memory bound for a full choice (residents rounded up to the quantum)."""
    picked = [c[i] for c, i in zip(cands, choice, strict=True)]
    return sum(math.ceil(p.resident / quantum) for p in picked) * quantum + max(p.transient for p in picked)


def _pareto(unit: list[Candidate], idxs: list[int]) -> list[int]:
    """Drop candidates another one beats on both resident bytes and time (e.g. needless splits)."""
    order = sorted(idxs, key=lambda i: (unit[i].resident, unit[i].time_s))
    kept: list[int] = []
    best_time = float("inf")
    for i in order:
        if unit[i].time_s < best_time:
            kept.append(i)
            best_time = unit[i].time_s
    return kept


def _knapsack(
    cands: list[list[Candidate]], allowed: list[list[int]], capacity: int, quantum: float
) -> tuple[float, list[int]] | None:
    """Min total time with sum of ceil(resident/quantum) <= capacity; None if nothing fits."""
    inf = np.inf
    dp = np.zeros(capacity + 1)
    picks = []
    for unit, idxs in zip(cands, allowed, strict=True):
        best = np.full(capacity + 1, inf)
        arg = np.full(capacity + 1, -1, dtype=np.int32)
        for i in idxs:
            w = math.ceil(unit[i].resident / quantum)
            if w > capacity:
                continue
            trial = np.full(capacity + 1, inf)
            trial[w:] = dp[: capacity + 1 - w] + unit[i].time_s
            better = trial < best
            best[better] = trial[better]
            arg[better] = i
        if not np.isfinite(best[-1]):
            return None
        dp = best
        picks.append(arg)
    choice: list[int] = []
    cap = capacity
    for unit, arg in zip(reversed(cands), reversed(picks), strict=True):
        i = int(arg[cap])
        choice.append(i)
        cap -= math.ceil(unit[i].resident / quantum)
    choice.reverse()
    return float(dp[-1]), choice


def solve(cands: list[list[Candidate]], budget: float, quantum: float | None = None) -> Solution | None:
    """Fastest choice with bound(choice) <= budget, or None when no choice fits."""
    quantum = quantum or quantum_for(budget)
    caps = sorted({c.transient for unit in cands for c in unit})
    min_cap = max(min(c.transient for c in unit) for unit in cands)
    best: Solution | None = None
    for cap in (c for c in caps if c >= min_cap):
        allowed = _allowed(cands, cap)
        room = budget - cap
        if room < 0:
            break
        pruned = [_pareto(unit, idxs) for unit, idxs in zip(cands, allowed, strict=True)]
        found = _knapsack(cands, pruned, int(room // quantum), quantum)
        if found and (best is None or found[0] < best.time_s):
            best = Solution(found[1], found[0], bound(cands, found[1], quantum), cap)
    return best


def _smallest(unit: list[Candidate], idxs: list[int]) -> int:
    return min(idxs, key=lambda i: (unit[i].resident, unit[i].time_s))


def least_bound(cands: list[list[Candidate]]) -> list[int]:
    """The choice with the smallest memory bound, whatever its time: for each cap on the largest
    transient, every unit's smallest resident under the cap."""
    best: tuple[float, list[int]] | None = None
    for cap in sorted({c.transient for unit in cands for c in unit}):
        allowed = _allowed(cands, cap)
        if not all(allowed):
            continue
        choice = [_smallest(unit, idxs) for unit, idxs in zip(cands, allowed, strict=True)]
        total = bound(cands, choice, 1.0)
        if best is None or total < best[0]:
            best = (total, choice)
    assert best is not None, "every unit has at least one candidate"
    return best[1]
