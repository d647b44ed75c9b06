"""Uniform plans: one strategy for every unit (the baselines OSDP is compared against).

`Baselines` finds each strategy's best plan once per plan made: the osdp search weighs them as
candidates, the plan records them for comparison, and a uniform planner returns its own.
"""

from torch import nn

from osdp_planners.assemble import make_plan
from osdp_planners.choice import Choice
from osdp_planners.evaluate import Context, evaluate
from osdp_planners.options import Option
from osdp_planners.plan import Baseline, Plan, Strategy, UnitPlan
from osdp_planners.request import PlanRequest
from osdp_planners.space import batch_candidates
from osdp_planners.units import Unit, find_units


def group_size(strategy: Strategy, req: PlanRequest) -> int:
    if strategy is Strategy.DDP:
        return 1
    if strategy is Strategy.HSDP:
        return req.default_hsdp_group()
    return req.world_size


def uniform_options(ctx: Context, req: PlanRequest, strategy: Strategy) -> dict[str, Option]:
    opt = Option(strategy, group_size(strategy, req))
    return {u.name: opt for u in ctx.profile.units}


def best_uniform(ctx: Context, req: PlanRequest, strategy: Strategy) -> Choice | None:
    """A uniform strategy at its best-throughput batch whose simulated peak fits."""
    options = uniform_options(ctx, req, strategy)
    best: Choice | None = None
    for batch, accum in batch_candidates(req):
        ev = evaluate(ctx, options, batch, accum)
        if ev.peak_bytes > ctx.usable_memory_bytes:
            if req.global_batch_size is None:
                break
            continue
        if best is None or ev.throughput > best.evaluation.throughput:
            best = Choice(options, batch, accum, ev)
    return best


def uniform_footprint(ctx: Context, req: PlanRequest, strategy: Strategy) -> Choice:
    """The least memory a uniform plan of `strategy` needs: at the smallest batch, as best_uniform plans it."""
    options = uniform_options(ctx, req, strategy)
    batch, accum = min(batch_candidates(req))
    return Choice(options, batch, accum, evaluate(ctx, options, batch, accum))


class Baselines:
    """Each strategy's best uniform plan in one context, found on first use and kept."""

    def __init__(self, ctx: Context, req: PlanRequest) -> None:
        self._ctx, self._req = ctx, req
        self._found: dict[Strategy, Choice | None] = {}

    def best(self, strategy: Strategy) -> Choice | None:
        if strategy not in self._found:
            self._found[strategy] = best_uniform(self._ctx, self._req, strategy)
        return self._found[strategy]

    def fitting(self) -> list[Choice]:
        return [c for c in (self.best(s) for s in Strategy) if c is not None]

    def records(self) -> dict[str, Baseline]:
        """What the plan document says of each: its batch and predictions, or that it does not fit."""
        out = {}
        for strategy in Strategy:
            found = self.best(strategy)
            if found is None:
                out[strategy.value] = Baseline(fits=False)
                continue
            ev = found.evaluation
            out[strategy.value] = Baseline(
                fits=True,
                micro_batch_size=found.micro_batch_size,
                peak_memory_bytes=int(ev.peak_bytes),
                step_time_s=ev.step_time_s,
                throughput_samples_per_s=ev.throughput,
            )
        return out


def unit_plans(units: list[Unit], strategy: Strategy, req: PlanRequest) -> list[UnitPlan]:
    g = group_size(strategy, req)
    return [
        UnitPlan(name=u.name, modules=list(u.modules), **Option(strategy, g).unit_fields(), param_count=u.param_count)
        for u in units
    ]


def uniform_plan(
    model: nn.Module, req: PlanRequest, strategy: Strategy, micro_batch_size: int, grad_accum_steps: int
) -> Plan:
    """A uniform plan document without predictions (no context needed), for tests and benchmarks."""
    units = unit_plans(find_units(model, req.seq_len), strategy, req)
    return make_plan(model, req, units, micro_batch_size, grad_accum_steps)
