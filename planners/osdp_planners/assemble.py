"""Plan assembly: the plan document every planner returns, and the explanation that goes with it."""

import json

from torch import nn

from osdp_planners.choice import Choice
from osdp_planners.cpu_wait import BUSY_SHARE, BUSY_TIMES
from osdp_planners.evaluate import Context
from osdp_planners.explanation import Explanation, jsonable
from osdp_planners.plan import EXTRAPOLATED, Baseline, Plan, Predicted, UnitPlan
from osdp_planners.request import PlanRequest
from osdp_planners.units import structure_hash


def make_plan(
    model: nn.Module, req: PlanRequest, units: list[UnitPlan], micro_batch_size: int, grad_accum_steps: int
) -> Plan:
    """The plan document for `model` (predictions filled in by the cost model, if any)."""
    return Plan(
        planner=req.planner,
        model=req.model_label,
        structure_hash=structure_hash(model),
        world_size=req.world_size,
        nodes=req.nodes,
        workers_per_node=req.workers_per_node,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seq_len=req.seq_len,
        precision=req.precision,
        compile=req.compile,
        memory_limit_bytes=req.memory_limit_bytes,
        memory_margin=req.margin,
        units=units,
    )


def _times_from(ctx: Context, micro_batch_size: int) -> str:
    """Planned offline (no device to time on), the plan says its times are the preset's; timed on a busy
    host, it says that its times are slow and how to measure them again; at a micro batch far beyond
    the timed ones, that its times are a line extrapolated that far."""
    if ctx.measured is not None:
        comm = ctx.topo.measured
        waited = max(ctx.measured.cpu_wait_share or 0.0, (comm.cpu_wait_share if comm else None) or 0.0)
        said = (
            f"{BUSY_TIMES}: the probe waited {waited:.0%} of its time for a CPU, so its times are "
            "slow; such a measurement is not kept: plan again on a quiet host"
            if waited > BUSY_SHARE
            else "measured"
        )
        if ctx.measured.extrapolated_to(micro_batch_size):
            timed = ctx.measured.batches
            said += (
                f"{',' if said == 'measured' else ';'} {EXTRAPOLATED} on a line from micro batches "
                f"{' and '.join(map(str, timed))} to {micro_batch_size}, {micro_batch_size / timed[-1]:g}x "
                "the largest timed: on CPU pools, before they were timed at their own batch, such steps ran up to "
                "2.2x the prediction"
            )
        return said
    device = ctx.topo.device
    return f"preset {device.name}: FLOPs at {device.flops_per_s / 1e12:g} TFLOP/s sustained"


def to_plan(model: nn.Module, req: PlanRequest, ctx: Context, choice: Choice, baselines: dict[str, Baseline]) -> Plan:
    """`choice` as the plan document, with its predictions, the uniform baselines and the search's report."""
    ev = choice.evaluation
    units = [
        UnitPlan(
            name=u.name,
            modules=list(u.modules),
            **choice.options[u.name].unit_fields(),
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
                times_from=_times_from(ctx, choice.micro_batch_size),
            ),
            "baselines": baselines,
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
