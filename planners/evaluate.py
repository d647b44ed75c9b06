"""The cost model in one place: a plan's per-rank peak memory, step time and throughput.

`Context` holds what does not change during a search (profile, measured times, topology, dtypes);
`evaluate` gives the numbers a plan is judged and reported by (memory from the event simulation);
`candidates` gives the search its decomposable view of the same quantities (see search.py).
"""

from dataclasses import dataclass

from osdp_planners.memory_model import ADAM_STATES, Timeline, simulate, unit_bytes
from osdp_planners.options import Option
from osdp_planners.plan import Strategy
from osdp_planners.profile import ModelProfile
from osdp_planners.search import Candidate
from osdp_planners.time_model import Topology, optimizer_seconds, unit_time
from osdp_planners.timing import MeasuredTimes


@dataclass(frozen=True)
class Context:
    profile: ModelProfile
    topo: Topology
    measured: MeasuredTimes | None
    compute_bytes: int  # 2 under bf16 mixed precision, else 4
    optimizer: str
    memory_limit: float

    @property
    def overlap(self) -> bool:
        return self.topo.device.accelerator == "gpu"

    @property
    def opt_states(self) -> int:
        return ADAM_STATES if self.optimizer == "adamw" else 0


@dataclass(frozen=True)
class Evaluation:
    peak_bytes: float
    step_time_s: float
    throughput: float  # samples per second
    unit_time_s: dict[str, float]
    unit_resident: dict[str, float]
    timeline: Timeline


def _retained(ctx: Context, unit: str, batch: int, checkpoint: bool) -> float:
    mods = ctx.profile.by_unit[unit]
    if checkpoint:
        return sum(m.output.at(batch) for m in mods)
    return sum(m.post_fw.at(batch) - m.pre_fw.at(batch) for m in mods)


def resident(ctx: Context, unit: str, opt: Option, batch: int) -> float:
    """What one unit keeps for the whole step in the search's bound."""
    b = unit_bytes(ctx.profile, unit, opt, ctx.compute_bytes, ctx.opt_states)
    held = b.gathered if opt.holds_params else 0.0
    return b.sharded + b.opt_state + max(_retained(ctx, unit, batch, opt.checkpoint) + held, b.grad_shard)


def neighbour_buffers(ctx: Context) -> dict[str, float]:
    """Per unit, the most its backward neighbours can leave alive at its events: the next unit's
    prefetched gather and the previous unit's pending reduce-scatter buffer (taken unsplit)."""
    order = list(dict.fromkeys(m.unit for m in reversed(ctx.profile.modules)))
    worst = {u: unit_bytes(ctx.profile, u, Option(Strategy.ZERO3, 1), ctx.compute_bytes, ctx.opt_states)
             for u in order}
    out = {}
    for i, u in enumerate(order):
        nxt = worst[order[i + 1]].gather_step if i + 1 < len(order) else 0.0
        prev = worst[order[i - 1]].reduce_buffer if i > 0 else 0.0
        out[u] = nxt + prev
    return out


def transient(ctx: Context, unit: str, opt: Option, local: float) -> float:
    """Bytes beyond the residents while this unit runs: activation peak, own and neighbours' buffers."""
    b = unit_bytes(ctx.profile, unit, opt, ctx.compute_bytes, ctx.opt_states)
    return local + b.gather_step + b.grad_full + b.reduce_buffer


def activation_local(ctx: Context, batch: int) -> dict[str, float]:
    """Per unit, the most activation bytes at its own events beyond what the units before it retain.

    A unit's own gradients, which the profiled backward peak includes, are left to its transient.
    The loss computation belongs to the last unit of the forward.
    """
    before = 0.0
    local: dict[str, float] = {}
    for m in ctx.profile.modules:
        grads = ctx.profile.param_bytes[m.unit] * ctx.compute_bytes / 4
        here = max(m.peak_fw.at(batch), m.peak_bw.at(batch) - grads, m.pre_fw.at(batch)) - before
        local[m.unit] = max(local.get(m.unit, 0.0), here)
        before += m.post_fw.at(batch) - m.pre_fw.at(batch)
    last = ctx.profile.modules[-1].unit
    local[last] = max(local[last], ctx.profile.peak_loss.at(batch) - before)
    return local


def unit_seconds(ctx: Context, unit: str, opt: Option, batch: int, accum: int) -> float:
    t = unit_time(ctx.profile, unit, opt, batch, ctx.topo, ctx.measured, ctx.compute_bytes, ctx.overlap)
    return accum * t.total_s + optimizer_seconds(ctx.profile, {unit: opt}, ctx.topo, ctx.measured)


def candidates(ctx: Context, unit: str, options: list[Option], batch: int, accum: int, local: float
               ) -> list[Candidate]:
    out = []
    for o in options:
        out.append(Candidate(resident(ctx, unit, o, batch), transient(ctx, unit, o, local),
                             unit_seconds(ctx, unit, o, batch, accum)))
    return out


def evaluate(ctx: Context, options: dict[str, Option], batch: int, accum: int) -> Evaluation:
    timeline = simulate(ctx.profile, options, batch, ctx.compute_bytes, ctx.optimizer)
    times = {u: unit_seconds(ctx, u, o, batch, accum) for u, o in options.items()}
    step = sum(times.values()) + accum * ctx.topo.step_fixed_s
    samples = batch * accum * ctx.topo.world_size
    return Evaluation(timeline.peak, step, samples / step, times,
                      {u: resident(ctx, u, o, batch) for u, o in options.items()}, timeline)
