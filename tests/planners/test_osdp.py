"""The OSDP search: exactness against brute force, and the memory bound's safety against the event timeline.

Pure planner logic (fake-tensor profiles of tiny zoo models, no Ray). Brute force enumerates every
combination with itertools.product and knows nothing about the dynamic program it checks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from helpers import ZooModel, context, plan_zoo, zoo_request
from osdp_planners import advice, osdp, uniform
from osdp_planners.choice import Choice
from osdp_planners.errors import NoPlanFits, UserError
from osdp_planners.evaluate import Context, Evaluation
from osdp_planners.hardware import GIB
from osdp_planners.memory_model import simulate
from osdp_planners.options import Option, unit_options
from osdp_planners.plan import Strategy
from osdp_planners.request import PlanRequest
from osdp_planners.search import BUCKETS, Candidate, bound, quantum_for, solve

pytestmark = pytest.mark.heavy

Cands = list[list[Candidate]]
REL = 1e-9  # float noise allowed when comparing times


class Enumeration:
    """Every full choice of an instance, as arrays: the brute force, independent of solve's DP."""

    def __init__(self, cands: Cands) -> None:
        self.cands = cands
        self.choices = np.array(list(itertools.product(*(range(len(unit)) for unit in cands))), dtype=np.int64)
        cols = range(len(cands))
        self.resident = np.array([[cands[u][i].resident for u, i in zip(cols, c, strict=True)] for c in self.choices])
        self.max_transient = np.array(
            [max(cands[u][i].transient for u, i in zip(cols, c, strict=True)) for c in self.choices]
        )
        self.time = np.array([sum(cands[u][i].time_s for u, i in zip(cols, c, strict=True)) for c in self.choices])

    def bounds(self, quantum: float) -> np.ndarray:
        """bound() of every choice: residents rounded up to the quantum one by one, plus the largest transient."""
        return np.ceil(self.resident / quantum).sum(axis=1) * quantum + self.max_transient

    def best(self, budget: float, quantum: float) -> tuple[float, list[int]] | None:
        """The fastest choice whose bound fits, or None."""
        fits = self.bounds(quantum) <= budget
        if not fits.any():
            return None
        k = int(np.argmin(np.where(fits, self.time, np.inf)))
        return float(self.time[k]), [int(i) for i in self.choices[k]]


def check_against_brute_force(every: Enumeration, budget: float, quantum: float | None = None) -> None:
    """solve's optimum equals the enumeration's, it is None exactly when nothing fits, and its choice fits."""
    cands = every.cands
    q = quantum or quantum_for(budget)
    expected = every.best(budget, q)
    got = solve(cands, budget, quantum)
    if expected is None:
        assert got is None, f"solve found {got} at budget {budget}, but no combination fits"
        return
    assert got is not None, f"solve found nothing at budget {budget}; brute force found {expected}"
    assert got.time_s == pytest.approx(expected[0], rel=REL), (budget, got, expected)
    assert len(got.choice) == len(cands)
    assert all(0 <= i < len(unit) for unit, i in zip(cands, got.choice, strict=True))
    chosen_time = sum(unit[i].time_s for unit, i in zip(cands, got.choice, strict=True))
    assert chosen_time == pytest.approx(got.time_s, rel=REL)
    assert bound(cands, got.choice, q) <= budget
    assert got.bound_bytes == bound(cands, got.choice, q)
    k = int(np.flatnonzero((every.choices == got.choice).all(axis=1))[0])
    assert every.bounds(q)[k] == bound(cands, got.choice, q)  # the enumeration measures what solve promises


# --- the bound itself, by hand -------------------------------------------------------------------------------


def test_bound_is_rounded_residents_plus_largest_transient() -> None:
    cands = [[Candidate(10.0, 5.0, 1.0), Candidate(3.0, 40.0, 2.0)], [Candidate(7.0, 1.0, 1.0)]]
    assert bound(cands, [0, 0], 1.0) == 10 + 7 + 5
    assert bound(cands, [1, 0], 1.0) == 3 + 7 + 40
    assert bound(cands, [0, 0], 4.0) == 12 + 8 + 5  # residents rounded up to the quantum, one by one
    assert quantum_for(100.0) == 1.0
    assert quantum_for(BUCKETS * 1000.0) == 1000.0


def test_solve_picks_the_known_optimum_of_a_hand_instance() -> None:
    # fast-but-big vs slow-but-small per unit; the budget admits exactly one fast unit, and the
    # large transient of unit 1's fast option must be paid once, as the max
    cands = [[Candidate(50, 0, 1.0), Candidate(10, 0, 3.0)], [Candidate(40, 30, 1.5), Candidate(10, 0, 2.0)]]
    assert solve(cands, 60.0).choice == [0, 1]  # 60 fits, time 3.0
    assert solve(cands, 60.0).time_s == pytest.approx(3.0)
    assert solve(cands, 20.0).choice == [1, 1]
    assert solve(cands, 19.0) is None
    assert solve(cands, 120.0).choice == [0, 0]  # 50 + 40 + 30


def test_enumeration_measures_the_same_bound_as_search() -> None:
    rng = random.Random(7)
    for integer in (True, False):
        for _ in range(20):
            every = Enumeration(random_instance(rng, integer))
            for quantum in (1.0, 977.0, 3.1e4):
                expected = [bound(every.cands, [int(i) for i in c], quantum) for c in every.choices]
                assert every.bounds(quantum).tolist() == expected


# --- brute force on random instances ------------------------------------------------------------------------


def random_instance(rng: random.Random, integer: bool) -> Cands:
    n_units = rng.randint(1, 5)
    out = []
    for _ in range(n_units):
        unit = []
        for _ in range(rng.randint(1, 6)):
            if integer:  # small integers: exact ties and exact boundary budgets (quantum 1 below BUCKETS)
                unit.append(
                    Candidate(
                        rng.randint(0, 300),
                        rng.choice([0, 0, rng.randint(0, 200)]),
                        rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 5.0)]),
                    )
                )
            else:
                unit.append(
                    Candidate(rng.uniform(0, 5e6), rng.uniform(0, 3e6) * rng.random() ** 2, rng.lognormvariate(0, 1))
                )
        out.append(unit)
    return out


def budgets_for(every: Enumeration, rng: random.Random, integer: bool) -> list[float]:
    """Budgets from below the smallest bound to above the largest, plus exact bound values."""
    raw = every.bounds(1.0)
    if integer:
        values = sorted({float(v) for v in raw})
        picks = rng.sample(values, min(6, len(values)))
        budgets = [values[0] - 1, values[-1] + 5, *picks, *(p - 1 for p in picks)]
        return [b for b in budgets if b <= BUCKETS]  # keep quantum 1, so the exact values are the bounds
    lo, hi = float(raw.min()), float(raw.max())
    return [0.5 * lo, 0.999 * lo, *(rng.uniform(lo, hi) for _ in range(5)), 1.01 * lo, hi * 1.01, 10 * hi]


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
def test_solve_matches_brute_force_on_random_instances(integer: bool) -> None:
    rng = random.Random(1234 + integer)
    checked = feasible = 0
    for _ in range(160):
        every = Enumeration(random_instance(rng, integer))
        for budget in budgets_for(every, rng, integer):
            check_against_brute_force(every, budget)
            checked += 1
            feasible += solve(every.cands, budget) is not None
    assert feasible > checked // 4 and feasible < checked  # both outcomes exercised


def test_solve_matches_brute_force_with_an_explicit_quantum() -> None:
    rng = random.Random(99)
    for _ in range(100):
        every = Enumeration(random_instance(rng, integer=False))
        lo, hi = float(every.bounds(1.0).min()), float(every.bounds(1.0).max())
        for budget in (lo * 0.9, (lo + hi) / 2, hi * 1.2):
            for scale in (0.37, 1.0, 25.0):  # the DP's table has budget / quantum cells: keep it small
                check_against_brute_force(every, budget, scale * quantum_for(budget))


# --- real candidates from a profiled zoo model --------------------------------------------------------------


def unit_option_lists(ctx: Context, workers: int) -> dict[str, list[Option]]:
    """Every option of every unit, as search_osdp lists them (one node)."""
    out = {}
    for u in ctx.profile.units:
        splittable = bool(ctx.profile.linear_bytes[u.name])
        checkpointable = any(m.unit == u.name for m in ctx.profile.modules)
        out[u.name] = unit_options(workers, workers, 1, splittable, checkpointable)
    return out


def search_candidates(ctx: Context, options: dict[str, list[Option]], batch: int, accum: int = 1) -> Cands:
    """The candidates search_osdp hands to solve (the last 'unit' stands for the loss and optimizer step)."""
    return osdp.search_candidates(ctx, list(options), options, batch, accum)


@pytest.mark.parametrize("seed", range(3))
def test_solve_matches_brute_force_on_real_candidates(seed: int) -> None:
    ctx = context("llama")  # 6 units: embed, 2 x (attn, mlp), head
    rng = random.Random(seed)
    full = unit_option_lists(ctx, 4)
    options = {u: rng.sample(opts, min(4, len(opts))) for u, opts in full.items()}
    for batch, accum in ((1, 1), (8, 2)):
        every = Enumeration(search_candidates(ctx, options, batch, accum))
        raw = np.sort(every.bounds(1.0))
        limits = [
            0.9 * raw[0],
            raw[0] * 1.001,
            *(raw[int(f * (len(raw) - 1))] for f in (0.05, 0.3, 0.6, 0.9)),
            raw[-1] * 1.001,
        ]
        outcomes = set()
        for limit in limits:
            check_against_brute_force(every, float(limit))
            outcomes.add(solve(every.cands, float(limit)) is None)
        assert outcomes == {True, False}
        quantum = float(raw[-1]) / BUCKETS
        exact = np.sort(every.bounds(quantum))
        for limit in exact[:: max(1, len(exact) // 7)]:  # exact bound values as limits, at a fixed quantum
            check_against_brute_force(every, float(limit), quantum)


# --- safety: the search's bound covers the simulated peak ---------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A tiny zoo model reshaped to stress one part of the bound, and the batches to check it at."""

    family: str
    precision: str = "fp32"
    optimizer: str = "adamw"
    workers: int = 4
    n_layers: int = 2
    vocab: int | None = None
    dim: int | None = None
    seq_len: int = 32
    batches: tuple[int, ...] = (1, 3, 16)

    def __str__(self) -> str:
        return (
            f"{self.family}-{self.precision}-{self.optimizer}-w{self.workers}-L{self.n_layers}"
            f"-v{self.vocab or 'tiny'}-d{self.dim or 'tiny'}-s{self.seq_len}"
        )


SAFETY_CASES = [
    Shape("llama"),
    Shape("llama", "bf16-mixed", "sgd", workers=2),
    Shape("gpt2"),
    Shape("gpt2", "bf16-mixed", workers=2),
    # wide vocabulary, narrow model, long sequences: the loss region dominates and the bound is within
    # about 0.01% of the simulated peak (the tightest case found)
    Shape("llama", "bf16-mixed", workers=2, n_layers=1, vocab=65536, dim=32, seq_len=128, batches=(16, 256)),
    # big embeddings, short sequences: parameters and their buffers dominate; dropping the reduce-scatter
    # buffer, the gathers or the backward peak from the bound breaks safety in these
    Shape("llama", "bf16-mixed", workers=8, vocab=65536, dim=64, seq_len=8, batches=(1, 4)),
    Shape("llama", workers=8, n_layers=1, vocab=65536, dim=256, seq_len=8, batches=(1, 4)),
    Shape("gpt2", workers=8, n_layers=1, vocab=65536, dim=256, seq_len=8, batches=(1, 4)),
    # the next unit's prefetched gather matters here (the neighbour term of the transient)
    Shape("gpt2", workers=8, n_layers=1, seq_len=8, batches=(1, 2)),
]


@pytest.mark.parametrize("shape", SAFETY_CASES, ids=str)
def test_bound_covers_the_simulated_peak(shape: Shape) -> None:
    s = shape
    ctx = context(s.family, s.n_layers, s.workers, s.precision, s.optimizer, s.vocab, s.dim, s.seq_len)
    options = unit_option_lists(ctx, s.workers)
    units = list(options)
    n_opts = max(len(o) for o in options.values())
    rng = random.Random(str(s))
    for batch in s.batches:
        cands = search_candidates(ctx, options, batch)
        uniform = [[k % len(options[u]) for u in units] for k in range(n_opts)]  # every option on every unit
        sampled = [[rng.randrange(len(options[u])) for u in units] for _ in range(60)]
        for choice in uniform + sampled:
            picked = {u: options[u][i] for u, i in zip(units, choice, strict=True)}
            peak = simulate(ctx.profile, picked, batch, ctx.compute_bytes, ctx.optimizer).peak
            # quantum 1 rounds each resident up by under a byte: the bound is (almost) the plain sum
            searched = bound(cands, [*choice, 0], 1.0)  # the last 'unit' is the loss and optimizer step
            assert searched >= peak, f"{s} batch {batch}: bound {searched:.0f} < simulated peak {peak:.0f}: {picked}"


# --- the planner end to end: infeasible limits and fitting plans --------------------------------------------


def smallest_need(ctx: Context, workers: int) -> float:
    """The least simulated peak at batch 1 over all-ZeRO-3 plans of every split and checkpoint setting."""
    peaks = []
    for split in (1, 2, 4, 8):
        for ckpt in (False, True):
            options = {
                u.name: Option(
                    Strategy.ZERO3,
                    workers,
                    split if ctx.profile.linear_bytes[u.name] else 1,
                    ckpt and any(m.unit == u.name for m in ctx.profile.modules),
                )
                for u in ctx.profile.units
            }
            peaks.append(simulate(ctx.profile, options, 1, ctx.compute_bytes, ctx.optimizer).peak)
    return min(peaks)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_smallest_footprint_is_no_larger_than_uniform_or_random_plans(family: str) -> None:
    ctx = context(family)
    options = unit_option_lists(ctx, 4)
    low = advice.smallest_footprint(ctx, zoo_request(family)).evaluation.peak_bytes
    assert low <= smallest_need(ctx, 4)
    rng = random.Random(5)
    for _ in range(200):
        picked = {u: rng.choice(opts) for u, opts in options.items()}
        assert simulate(ctx.profile, picked, 1, ctx.compute_bytes, ctx.optimizer).peak >= low, picked


def gib_after(text: str, words: str) -> tuple[float, float]:
    """The GiB figure printed after `words`, and half a unit of its last printed digit (its rounding)."""
    found = re.search(re.escape(words) + r"\D*?(\d+(?:\.(\d+))?) GiB", text)
    assert found, f"no '{words} ... GiB' in {text!r}"
    return float(found.group(1)), 0.5 * 10.0 ** -len(found.group(2) or "")


@pytest.mark.parametrize(
    ("family", "vocab", "dim"), [("llama", None, None), ("gpt2", None, None), ("llama", 1024, 128)]
)  # 0.0032037 GiB: rounds down
def test_infeasible_limit_names_the_smallest_footprint_and_the_threshold_holds(
    family: str, vocab: int | None, dim: int | None
) -> None:
    ctx = context(family, vocab_size=vocab, dim=dim)
    need = advice.smallest_footprint(ctx, zoo_request(family)).evaluation.peak_bytes
    assert need <= smallest_need(ctx, 4)  # never more than the plainest smallest plans need
    build = ZooModel(family, 2, vocab, dim)
    with pytest.raises(UserError) as err:
        plan_zoo(build, zoo_request(family, limit=math.floor(need) - 1))
    assert err.value.field == "planner.memory_limit_gb"
    named, rounding = gib_after(err.value.problem, "smallest footprint")
    assert abs(named - need / GIB) <= rounding * (1 + 1e-9), (named, need / GIB)
    # the advice must be enough: a limit of what it asks for, as printed, has to fit the smallest plan
    advised, _ = gib_after(err.value.fix, "at least")
    assert advised * GIB >= need, f"the fix asks for {advised} GiB, but the smallest footprint is {need / GIB} GiB"
    # at exactly the smallest footprint a plan exists (the simulated fallback), and it fits
    plan = plan_zoo(build, zoo_request(family, limit=math.ceil(need))).plan
    assert plan.predicted.peak_memory_bytes <= math.ceil(need)


@pytest.mark.parametrize(
    ("family", "factor", "global_batch"),
    [("llama", 1.3, None), ("llama", 4.0, None), ("gpt2", 2.0, 64), ("gpt2", 40.0, None)],
)
def test_planned_peak_fits_the_limit(family: str, factor: float, global_batch: int | None) -> None:
    ctx = context(family)
    need = advice.smallest_footprint(ctx, zoo_request(family)).evaluation.peak_bytes
    limit = int(factor * need)
    result = plan_zoo(ZooModel(family, 2), zoo_request(family, limit=limit, global_batch=global_batch))
    plan = result.plan
    assert plan.predicted.peak_memory_bytes is not None
    assert plan.predicted.peak_memory_bytes <= limit
    # the reported peak is the event timeline of the plan as written (recomputed from the plan's units)
    chosen = {u.name: Option.of(u) for u in plan.units}
    peak = simulate(
        result.context.profile, chosen, plan.micro_batch_size, ctx.compute_bytes, ctx.optimizer, plan.grad_accum_steps
    ).peak
    assert plan.predicted.peak_memory_bytes == int(peak)
    assert peak <= limit
    if global_batch is not None:
        assert plan.global_batch_size == global_batch


def choice(throughput: float, *kinds: Option) -> Choice:
    """A plan of one unit per option with a given predicted throughput (what prefer_simpler reads)."""
    ev = Evaluation(
        peak_bytes=0.0,
        step_time_s=1 / throughput,
        throughput=throughput,
        unit_seconds={},
        unit_resident={},
        timeline=None,
    )  # type: ignore[arg-type]  # unused by the choice
    return Choice({f"u{i}": o for i, o in enumerate(kinds)}, 1, 1, ev)


def test_a_harder_plan_must_be_predicted_clearly_faster() -> None:
    dp, zero2, zero3 = Option(Strategy.DDP, 1), Option(Strategy.ZERO2, 4), Option(Strategy.ZERO3, 4)
    uniform_dp, mixed = choice(100.0, dp, dp), choice(102.0, dp, zero2)
    assert osdp.prefer_simpler([mixed, uniform_dp]) is uniform_dp  # 2% is well inside the model's error
    clearly = choice(112.0, dp, zero2)
    assert osdp.prefer_simpler([uniform_dp, clearly]) is clearly
    uniform_zero3 = choice(101.0, zero3, zero3)
    assert osdp.prefer_simpler([uniform_zero3, mixed]) is mixed  # ZeRO-3 everywhere runs harder than ZeRO-2
    split = choice(102.5, dp, Option(Strategy.DDP, 1, split=2))
    assert osdp.prefer_simpler([split, uniform_dp]) is uniform_dp


@pytest.mark.parametrize("factor", [1.3, 2.0, 40.0])
def test_osdp_never_trails_a_fitting_uniform_plan_by_more_than_the_resolution(factor: float) -> None:
    ctx = context("llama")
    need = advice.smallest_footprint(ctx, zoo_request("llama")).evaluation.peak_bytes
    plan = plan_zoo(ZooModel("llama", 2), zoo_request("llama", limit=int(factor * need))).plan
    got = plan.predicted.throughput_samples_per_s
    assert got is not None
    for name, b in plan.baselines.items():
        if b.fits:
            assert b.throughput_samples_per_s is not None
            assert got * (1 + osdp.NEAR_TIE) >= b.throughput_samples_per_s, (name, got, b.throughput_samples_per_s)


@pytest.mark.parametrize("planner", ["ddp", "zero2", "zero3", "hsdp"])
def test_a_uniform_planners_advised_minimum_plans_under_that_planner(planner: str) -> None:
    """The advice names a budget the planner asked can use: its own strategy's footprint, not OSDP's
    (the uniform planners advised OSDP's minimum, at which they failed again), and OSDP's beside it."""
    build = ZooModel("gpt2", 2)
    req = dataclasses.replace(zoo_request("gpt2", limit=1 << 16), planner=planner)
    with pytest.raises(NoPlanFits) as err:
        plan_zoo(build, req)
    advised = err.value.advised_gb
    assert f"at least {advised:.4f} GiB" in err.value.fix
    plan = plan_zoo(build, dataclasses.replace(req, memory_limit_bytes=math.ceil(advised * GIB))).plan
    assert plan.planner == planner and {u.strategy.value for u in plan.units} == {planner}
    assert plan.predicted.peak_memory_bytes <= advised * GIB
    mixed, _ = gib_after(err.value.fix, "fits from")
    assert mixed <= advised
    assert plan_zoo(build, dataclasses.replace(req, planner="osdp", memory_limit_bytes=math.ceil(mixed * GIB))).plan


@pytest.mark.parametrize("factor", [1.3, 40.0])
def test_every_plan_records_the_fastest_found_and_what_the_near_tie_rule_cost(factor: float) -> None:
    ctx = context("llama")
    need = advice.smallest_footprint(ctx, zoo_request("llama")).evaluation.peak_bytes
    req = zoo_request("llama", limit=int(factor * need))
    simple = plan_zoo(ZooModel("llama", 2), req).plan
    fastest = plan_zoo(ZooModel("llama", 2), dataclasses.replace(req, prefer_simpler=False)).plan
    assert simple.search is not None and fastest.search is not None
    best = fastest.predicted.throughput_samples_per_s
    assert best is not None and simple.predicted.throughput_samples_per_s is not None
    assert fastest.search.simplicity_cost == 0.0 and fastest.search.best.throughput_samples_per_s == best
    for b in fastest.baselines.values():  # without the rule nothing that fits is predicted faster
        assert not b.fits or (b.throughput_samples_per_s or 0) <= best * (1 + 1e-9)
    assert simple.search.best.throughput_samples_per_s == pytest.approx(best, rel=1e-9)
    got = simple.predicted.throughput_samples_per_s
    assert simple.search.simplicity_cost == pytest.approx(1 - got / best, abs=1e-12)
    assert got * (1 + osdp.NEAR_TIE) >= best
    assert ("prefer_simpler" in simple.search.chosen_by) == (got < best)


@pytest.mark.parametrize("planner", ["osdp", "zero3", "manual"])
def test_each_uniform_baseline_is_found_once_per_plan(
    planner: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The search weighs the uniform plans, the plan records them and a uniform planner returns one: one
    search per strategy serves all three."""
    calls: Counter[Strategy] = Counter()
    found = uniform.best_uniform

    def counted(ctx: Context, req: PlanRequest, strategy: Strategy) -> Choice | None:
        calls[strategy] += 1
        return found(ctx, req, strategy)

    req = dataclasses.replace(zoo_request("llama"), planner=planner)
    if planner == "manual":
        path = tmp_path / "plan.json"
        path.write_text(plan_zoo(ZooModel("llama", 2), zoo_request("llama")).plan.to_json())
        req = dataclasses.replace(req, plan_file=str(path))
    monkeypatch.setattr(uniform, "best_uniform", counted)
    plan = plan_zoo(ZooModel("llama", 2), req).plan
    assert calls == {s: 1 for s in Strategy}
    assert set(plan.baselines) == {s.value for s in Strategy}


def test_no_plan_fits_advises_a_pool_of_whole_nodes_on_which_one_does() -> None:
    """Where sharding over more devices would fit, the refusal names that many nodes, and planning on them
    at the same budget fits; where what a device holds alone is too much, it names no count."""
    build = ZooModel("llama", 2)
    req = zoo_request("llama", 2)
    with pytest.raises(NoPlanFits) as tight:
        plan_zoo(build, dataclasses.replace(req, memory_limit_bytes=1 << 16))
    need = tight.value.advised_gb * GIB  # the least budget on 2 workers
    budget = int(0.8 * need)
    with pytest.raises(NoPlanFits) as err:
        plan_zoo(build, dataclasses.replace(req, memory_limit_bytes=budget))
    found = re.search(r"train on (\d+) node\(s\) of 2 such devices \((\d+) in all", err.value.fix)
    assert found, err.value.fix
    nodes = int(found.group(1))
    assert nodes > 1 and int(found.group(2)) == 2 * nodes
    plan = plan_zoo(build, dataclasses.replace(req, nodes=nodes, memory_limit_bytes=budget)).plan
    assert plan.world_size == 2 * nodes and plan.predicted.peak_memory_bytes <= req.margin.usable(budget)
    assert "node(s)" not in tight.value.fix and "add devices" not in tight.value.fix
    assert "more devices will not do: sharded over 1024 nodes" in tight.value.fix, tight.value.fix


def test_a_refusal_at_a_fixed_micro_batch_names_it_and_advises_a_smaller_one() -> None:
    """A recipe that fixes the micro batch is refused at that batch, not 'at any batch size', and a
    smaller micro batch is among the fixes."""
    build = ZooModel("llama", 2)
    with pytest.raises(NoPlanFits) as err:
        plan_zoo(build, zoo_request("llama", 2, micro_batch=8, limit=1 << 16))
    assert "no plan fits at micro batch 8 (train.micro_batch_size)" in err.value.problem, err.value.problem
    assert "lower train.micro_batch_size" in err.value.fix, err.value.fix
    with pytest.raises(NoPlanFits) as free:
        plan_zoo(build, zoo_request("llama", 2, limit=1 << 16))
    assert "micro batch" not in free.value.fix and "train.micro_batch_size" not in free.value.problem
