"""The exact search (planners/osdp_planners/milp.py) against brute force over the simulated objective, and ties.

Pure planner logic (fake-tensor profiles of tiny zoo models, no Ray). The brute force scores every
combination of options with evaluate() (the simulated peak and the step time the plan reports) and
knows nothing about the program it checks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from helpers import context, zoo_request
from osdp_planners import advice, batch_search, osdp, space
from osdp_planners.dominance import undominated
from osdp_planners.evaluate import Bound, Context, evaluate, unit_seconds
from osdp_planners.hardware import GIB
from osdp_planners.milp import least_peak
from osdp_planners.options import Option
from osdp_planners.plan import Strategy

BATCH = 8


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    n_layers: int
    workers: int
    seq_len: int
    per_unit: int  # options sampled per unit (the brute force tries per_unit ** units plans)
    seed: int

    def __str__(self) -> str:
        return f"{self.family}-L{self.n_layers}-w{self.workers}-s{self.seq_len}-k{self.per_unit}-{self.seed}"


CASES = [
    Case("llama", 1, 2, 64, 5, 0),
    Case("llama", 1, 4, 64, 5, 1),
    Case("gpt2", 1, 4, 32, 5, 2),
    Case("gpt2", 1, 2, 64, 6, 3),
]


class BruteForce:
    """Every plan of a case, scored by evaluate()."""

    def __init__(self, ctx: Context, options: dict[str, list[Option]]) -> None:
        self.units = list(options)
        self.plans = [dict(zip(self.units, combo, strict=True)) for combo in itertools.product(*options.values())]
        scored = [evaluate(ctx, p, BATCH, 1) for p in self.plans]
        self.peak = np.array([e.peak_bytes for e in scored])
        self.step = np.array([e.step_time_s for e in scored])

    def fastest_fitting(self, limit: float) -> float | None:
        fits = self.peak <= limit
        return float(self.step[fits].min()) if fits.any() else None

    def budgets(self) -> list[float]:
        """Midway between distinct peaks (no budget sits on a peak within solver tolerance), tight ones first."""
        peaks = np.unique(self.peak)
        gaps = [(a + b) / 2 for a, b in itertools.pairwise(peaks) if b - a > 1e-5 * b]
        picks = [gaps[int(f * (len(gaps) - 1))] for f in (0.0, 0.01, 0.03, 0.1, 0.3, 0.6, 1.0)]
        return [0.999 * peaks[0], *sorted(set(picks)), 1.01 * peaks[-1]]


def sampled_options(ctx: Context, case: Case) -> dict[str, list[Option]]:
    full = space.unit_option_lists(ctx, zoo_request(case.family, case.workers, seq_len=case.seq_len, micro_batch=BATCH))
    rng = random.Random(case.seed)
    return {u: rng.sample(opts, min(case.per_unit, len(opts))) for u, opts in full.items()}


def searched(ctx: Context, mode: str, options: dict[str, list[Option]], limit: float) -> dict[str, Option] | None:
    limited = dataclasses.replace(ctx, usable_memory_bytes=limit)
    found = osdp.search_batch(limited, mode, list(options), options, BATCH, 1)
    return None if found is None else {u: options[u][i] for u, i in zip(options, found, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_milp_is_the_brute_force_optimum_of_the_simulated_objective(case: Case) -> None:
    ctx = context(case.family, case.n_layers, case.workers, seq_len=case.seq_len, micro_batch=BATCH)
    options = sampled_options(ctx, case)
    every = BruteForce(ctx, options)
    gains = 0
    for limit in every.budgets():
        expected = every.fastest_fitting(limit)
        got = searched(ctx, "milp", options, limit)
        if expected is None:
            assert got is None, f"{case}: the MILP returned {got} at {limit:.0f} B, but no plan fits"
            continue
        assert got is not None, f"{case}: the MILP found nothing at {limit:.0f} B; brute force: {expected}"
        ev = evaluate(ctx, got, BATCH, 1)
        assert ev.peak_bytes <= limit
        assert ev.step_time_s == pytest.approx(expected, rel=1e-6), (case, limit, got)
        dp = searched(ctx, "knapsack", options, limit)
        dp_step = np.inf if dp is None else evaluate(ctx, dp, BATCH, 1).step_time_s
        assert dp_step >= expected * (1 - 1e-6)  # the knapsack never beats the optimum of what it bounds
        gains += dp_step > expected * (1 + 1e-6)
        auto = searched(ctx, "auto", options, limit)
        assert auto is not None
        assert evaluate(ctx, auto, BATCH, 1).step_time_s == pytest.approx(expected, rel=1e-6)
    # the smallest footprint of the exact program is the least simulated peak of all plans
    bound = Bound(ctx, BATCH, 1)
    bound.add_neighbour_buffers(options)
    costs = batch_search.unit_costs(ctx, bound, list(options), options, BATCH, 1)
    least = least_peak(bound, list(options), options, costs)
    assert least is not None
    plan = {u: options[u][i] for u, i in zip(options, least, strict=True)}
    assert evaluate(ctx, plan, BATCH, 1).peak_bytes == pytest.approx(every.peak.min(), rel=1e-9)
    if case.seed == 0:  # the case the README quotes: the bound's plan is strictly slower at tight budgets
        assert gains >= 1


def test_exact_mode_gains_over_the_knapsack_on_the_tiny_recipe() -> None:
    """The tiny recipe's model (Llama tiny, 2 layers, 2 workers, seq 64, micro batch 8), every option,
    at 1.2x the least memory any plan needs: the knapsack's bound rejects what the simulation fits."""
    ctx = context("llama", 2, 2, seq_len=64, micro_batch=BATCH)
    req = zoo_request("llama", 2, seq_len=64, micro_batch=BATCH)
    options = space.unit_option_lists(ctx, req)
    least = advice.smallest_footprint(ctx, req).evaluation.peak_bytes
    assert searched(ctx, "knapsack", options, 1.05 * least) is None  # only the exact search finds a plan here
    assert searched(ctx, "milp", options, 1.05 * least) is not None
    limit = 1.2 * least
    dp, exact = searched(ctx, "knapsack", options, limit), searched(ctx, "milp", options, limit)
    assert dp is not None
    assert exact is not None
    ev_dp, ev_exact = evaluate(ctx, dp, BATCH, 1), evaluate(ctx, exact, BATCH, 1)
    assert ev_exact.peak_bytes <= limit
    assert ev_dp.peak_bytes <= limit
    assert ev_exact.throughput > 1.1 * ev_dp.throughput, (ev_exact.throughput, ev_dp.throughput)


@pytest.mark.parametrize("mode", ["knapsack", "milp", "auto"])
def test_ties_resolve_to_the_fastest_runtime(mode: str) -> None:
    """Where everything fits, the plan is uniform DP, not HSDP(1) or a mix the time model prices the same."""
    ctx = context("llama", 2, 2, seq_len=64, micro_batch=BATCH)
    req = zoo_request("llama", 2, seq_len=64, micro_batch=BATCH, search=mode)
    units = [u.name for u in ctx.profile.units]
    for u in units:  # the tie is real: the time model charges DP and HSDP over groups of one the same
        assert unit_seconds(ctx, u, Option(Strategy.DDP, 1), BATCH, 1) == unit_seconds(
            ctx, u, Option(Strategy.HSDP, 1), BATCH, 1
        )
    options = space.unit_option_lists(ctx, req)
    chosen = searched(ctx, mode, options, 8 * GIB)
    assert chosen == {u: Option(Strategy.DDP, 1) for u in units}
    choice = osdp.search_osdp(ctx, req)
    assert choice is not None
    assert choice.options == {u: Option(Strategy.DDP, 1) for u in units}


@pytest.mark.parametrize("seed", range(4))
def test_undominated_keeps_exactly_the_options_nothing_beats(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 40
    costs = list(rng.integers(0, 6, n).astype(float))  # small ranges: ties in cost and in memory happen
    rows = rng.integers(0, 3, (n, 3)).astype(float)
    kept = set(undominated(costs, rows))

    def beats(a: int, b: int) -> bool:
        return costs[a] <= costs[b] and bool(np.all(rows[a] <= rows[b]))

    for i in range(n):
        if i not in kept:
            assert any(beats(k, i) for k in kept), i  # what goes is beaten by something that stays
    for a, b in itertools.permutations(kept, 2):  # nothing that stays is beaten (equals keep one of them)
        assert not beats(a, b), (a, b)


@pytest.mark.parametrize("case", CASES[1:2], ids=str)
def test_certified_search_is_within_its_gap_and_its_bound_holds(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on programs it does not solve exactly (forced here on small ones): its plan within
    CERTIFIED_GAP of brute force, and the bound it proves never below the brute-force optimum."""
    monkeypatch.setattr(batch_search, "AUTO_MILP_BINARIES", 0)
    ctx = context(case.family, case.n_layers, case.workers, seq_len=case.seq_len, micro_batch=BATCH)
    options = sampled_options(ctx, case)
    every = BruteForce(ctx, options)
    for limit in every.budgets():
        expected = every.fastest_fitting(limit)
        limited = dataclasses.replace(ctx, usable_memory_bytes=limit)
        inst = batch_search.Instance(limited, list(options), options, BATCH, 1)
        found = batch_search.search(inst, "auto")
        if expected is None:
            assert found.choice is None
            continue
        best = BATCH * ctx.topo.world_size / expected
        assert math.isfinite(inst.relaxed) and inst.upper(found.lower) >= best * (1 - 1e-9), (case, limit)
        assert found.choice is not None
        plan = {u: options[u][i] for u, i in zip(options, found.choice, strict=True)}
        ev = evaluate(ctx, plan, BATCH, 1)
        assert ev.peak_bytes <= limit
        assert ev.throughput >= best * (1 - batch_search.CERTIFIED_GAP) - 1e-9, (case, limit)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
def test_relax_and_fix_plans_fit_and_never_beat_the_optimum(case: Case) -> None:
    """The plan that keeps what the relaxation decided (relax_and_fix.py) fits, costs no less than brute
    force's optimum, and is bounded by the relaxation, not by its own restricted program: in these cases
    fixing misses the optimum at some budgets."""
    ctx = context(case.family, case.n_layers, case.workers, seq_len=case.seq_len, micro_batch=BATCH)
    options = sampled_options(ctx, case)
    every = BruteForce(ctx, options)
    found_any = 0
    for limit in every.budgets():
        expected = every.fastest_fitting(limit)
        limited = dataclasses.replace(ctx, usable_memory_bytes=limit)
        inst = batch_search.Instance(limited, list(options), options, BATCH, 1)
        found = inst.fixed(batch_search.AUTO_TIME_LIMIT_S)
        if expected is None:
            assert found.choice is None, (case, limit)
            continue
        assert inst.upper(found.lower) >= BATCH * ctx.topo.world_size / expected * (1 - 1e-9), (case, limit)
        if found.choice is None:
            continue
        ev = evaluate(ctx, {u: options[u][i] for u, i in zip(options, found.choice, strict=True)}, BATCH, 1)
        assert ev.peak_bytes <= limit, (case, limit)
        assert ev.step_time_s >= expected * (1 - 1e-6), (case, limit)
        found_any += 1
    assert found_any >= len(every.budgets()) // 2, found_any


def test_default_search_is_within_its_gap_of_the_exact_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto against milp over every option and micro batch of an 8-layer model at a tight budget, auto made to
    certify instead of solving exactly (as it does at scale): its fastest plan within CERTIFIED_GAP of
    milp's, and the bound it proves above milp's plan."""
    monkeypatch.setattr(batch_search, "AUTO_MILP_BINARIES", 0)
    ctx = context("llama", 8, 4, seq_len=64, micro_batch=BATCH)
    req = zoo_request("llama", 4, seq_len=64, global_batch=64)
    least = advice.smallest_footprint(ctx, req).evaluation.peak_bytes
    tight = dataclasses.replace(ctx, usable_memory_bytes=1.3 * least)
    found = {}
    for mode in ("auto", "milp"):
        choice = osdp.search_osdp(tight, dataclasses.replace(req, search=mode, prefer_simpler=False))
        assert choice is not None and choice.report is not None
        assert choice.evaluation.peak_bytes <= tight.usable_memory_bytes
        found[mode] = choice.report
    exact = found["milp"].best.throughput_samples_per_s
    auto = found["auto"].best.throughput_samples_per_s
    upper = found["auto"].throughput_upper_bound
    assert exact is not None and auto is not None and upper is not None
    assert auto >= exact * (1 - batch_search.CERTIFIED_GAP), (auto, exact)
    assert upper >= exact * (1 - 1e-9), (upper, exact)
