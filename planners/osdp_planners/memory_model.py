"""Per-rank memory over one training step under FSDP2, as a sum of per-unit contributions.

The step is a fixed sequence of events (step_layout.py: each unit's all-gather and its modules' forwards, the
loss, each unit's backward gather, its modules' backwards and its reduce-scatter, the optimizer
step). At every event the bytes one rank holds are an option-independent base (activations no
unit owns: the input, the gradient flowing back, the loss region) plus, for every unit, what the
unit holds there under its option. A unit's contribution is a few constant segments of the event
sequence, so the level at any event is linear in the one-hot choice of options: the search can
bound it per unit (evaluate.py) and solve it exactly (milp.py), and `simulate` adds it up.

What a unit holds, as FSDP2 (torch 2.13) does it:
- always: its sharded fp32 parameters and optimizer states (DP: the whole unit, a "sharded" copy
  of group size one), and from its reduce-scatter until the optimizer step its sharded gradients
  (a split Linear's from its own backward; for the whole step when gradients accumulate);
- activations from the profile under its variant (split, checkpointed): what its modules keep from
  their forward until their backward, and their peaks during forward and backward (the unsharded
  gradients FSDP2 holds until the reduce-scatter included, see recorder.py);
- unsharded parameters (compute dtype): ZeRO-3/HSDP from the all-gather until the unit's forward
  ends and again from its backward gather until its reduce-scatter; DP/ZeRO-2 from the forward
  all-gather until the reduce-scatter; a split Linear's slices are units of their own, gathered one
  at a time under ZeRO-3/HSDP;
- the all-gather output (only where the shard group is larger than one rank): kept in forward
  until the next unit's all-gather, freed at once in backward, and in backward issued by the unit
  before it (prefetch) and pending during that unit's backward. Where that unit is split, FSDP2
  issues it only at the unit's last slice, late in its backward; it is counted over the whole
  backward all the same (an over-count: its bytes are the next unit's option, its start this
  unit's, and counting it from the start keeps every level a sum of per-unit terms);
- the reduce-scatter input (fp32, the reduce dtype), kept until the next unit's reduce-scatter, and
  its output beside it when gradients accumulate (added to the kept gradient, not taken as it);
- on GPUs the optimizer's foreach temporaries (about one copy of the parameters it updates); on
  CPUs the per-tensor loop's (about two copies of the largest parameter), in the base.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from osdp_planners.options import Option, Variant
from osdp_planners.plan import Strategy
from osdp_planners.profile import ModelProfile, ModuleProfile
from osdp_planners.step_layout import Layout, layout_of, slot_range

ADAM_STATES = 2  # exp_avg, exp_avg_sq: fp32, sharded like the parameters
CPU_OPTIMIZER_TEMPS = 2  # the per-parameter AdamW loop allocates about two parameter-sized temporaries


def variant_of(profile: ModelProfile, unit: str, opt: Option) -> Variant:
    """The profiled variant an option runs its unit's modules as: a unit without Linears has no split,
    and one without modules of its own (the root's parameters) nothing to recompute."""
    split = opt.split if profile.linears.get(unit) else 1
    return Variant(split, opt.checkpoint and unit in profile.by_unit)


@dataclass(frozen=True)
class Footprint:
    """One unit under one option: segments (first slot, last slot, bytes) over the step, plus buffers
    that live at other units' events (Layout's fw_buffer, prefetch, reduce_buffer) and at the
    optimizer step.

    Slots are positions relative to the unit's own events (UnitEvents.anchors), so that identical
    units anywhere in the model share one footprint: slot 2k+1 is own event k, slot 2k the events
    between own events k-1 and k (slot 0: every event before the first, slot 2n: every event after
    the last; a slot between adjacent own events holds no event).
    """

    segments: tuple[tuple[int, int, float], ...]
    fw_buffer: float
    prefetch: float
    reduce_buffer: float
    optimizer_temp: float


@dataclass(frozen=True)
class Settings:
    """What a footprint depends on beyond the unit and its option."""

    micro_batch_size: int
    grad_accum_steps: int = 1
    compute_bytes: int = 4
    opt_states: int = ADAM_STATES
    gpu: bool = False
    alone: bool = False  # a world of one: no FSDP2 (runtime.apply), so the strategy changes nothing


def footprint(profile: ModelProfile, layout: Layout, unit: str, opt: Option, s: Settings) -> Footprint:
    """What `unit` holds at each event of the step under `opt` (see the module docstring)."""
    ev = layout.units[unit]
    slot = {e: 2 * i + 1 for i, e in enumerate(ev.anchors)}  # own event -> its slot; +1 is the gap after it
    start, end = 0, 2 * len(ev.anchors)
    mods: list[ModuleProfile] = profile.by_unit[unit]
    v = variant_of(profile, unit, opt)
    acts = {m.key: m.variants[v] for m in mods}
    b = s.micro_batch_size
    g = opt.shard_group_size
    ratio = s.compute_bytes / 4
    full = float(profile.param_bytes[unit])
    linears = profile.linears.get(unit, [])
    split = v.split > 1
    rest = full - sum(lin.param_bytes for lin in linears) if split else full
    piece = max((lin.slice_bytes(v.split) for lin in linears), default=0.0) if split else 0.0
    split_modules = {m.key for m in mods if split and any(lin.within(m.path) for lin in linears)}
    first, last = mods[0].key, mods[-1].key
    reshards = not s.alone and opt.strategy in (Strategy.ZERO3, Strategy.HSDP)
    sharded = g > 1
    segs: list[tuple[int, int, float]] = []

    def add(a: int, z: int, value: float) -> None:
        if value:
            segs.append((a, z, value))

    shard = full / g
    reduce = slot[ev.reduce]
    add(start, end, shard * (1 + s.opt_states))
    add(start if s.grad_accum_steps > 1 else reduce, end, shard)
    for m in mods:
        fw, bw = slot[ev.forward[m.key]], slot[ev.backward[m.key]]
        add(fw + 1, reduce if m.key == first else bw, acts[m.key].keep.at(b))
        add(fw, fw, acts[m.key].fw_peak.at(b))
        add(bw, bw, acts[m.key].bw_peak.at(b))
        if m.key in split_modules:
            # one slice gathered at a time under ZeRO-3/HSDP (all of them stay under DP/ZeRO-2, counted
            # below), with its all-gather output and the one before it; in backward the next slice's
            # prefetched all-gather output. A checkpointed unit's recomputation gathers its slices and
            # FSDP2 keeps each until its own backward: then all of them are held.
            sliced = sum(lin.param_bytes for lin in linears if lin.within(m.path))
            held = sliced if v.checkpoint else piece
            add(fw, fw, piece * ratio * (reshards + 2 * sharded))
            add(bw, bw, (held * reshards + piece * sharded) * ratio)
            if s.grad_accum_steps == 1:
                # each slice is reduce-scattered as its backward ends and FSDP2 keeps its fp32 shard:
                # within the module's backward at most the peak between the profile's two readings
                # (max of a + r/g <= max a + (max (a + r) - max a) / g), and all of them after it
                unreduced = acts[m.key].bw_unreduced.at(b) - acts[m.key].bw_peak.at(b)
                add(bw, bw, unreduced / ratio / g)
                add(bw + 1, reduce - 1, sliced / g)
    add(reduce, reduce, acts[first].bw_post.at(b) + rest)  # its reduce-scatter input is fp32
    if reshards:
        add(slot[ev.gather], slot[ev.forward[last]], rest * ratio)
        add(slot[ev.backward_gather], slot[ev.backward[first]], rest * ratio)
    elif not s.alone or ratio < 1:
        # alone, autocast saves each weight's compute-dtype copy for its backward; in fp32 it uses the
        # parameters themselves (measured on the tiny llama: the same peak under every strategy)
        add(slot[ev.gather], slot[ev.backward[first]], full * ratio)
    if sharded:  # the all-gather output of its own gathers
        add(slot[ev.gather], slot[ev.gather], rest * ratio)
        if not split:
            for m in mods:
                add(slot[ev.forward[m.key]], slot[ev.forward[m.key]], full * ratio)
        if reshards:
            add(slot[ev.backward_gather], slot[ev.backward_gather], rest * ratio)
    last_gather = (piece if split_modules else rest) * ratio if sharded else 0.0
    # when gradients accumulate FSDP2 adds the reduce-scatter's output to the gradient kept so far, so
    # the output stays a buffer of its own beside the input, instead of becoming the gradient
    reduce_buffer = rest + (rest / g if s.grad_accum_steps > 1 else 0.0)
    return Footprint(
        tuple(segs), last_gather, rest * ratio if reshards and sharded else 0.0, reduce_buffer, shard if s.gpu else 0.0
    )


def root_bytes(profile: ModelProfile, unit: str, opt: Option, s: Settings) -> float:
    """What the root unit (parameters no other unit claims) holds: FSDP2 gathers it before the first
    forward and frees it after the last backward, so all of it, all step, with its gradients."""
    full = float(profile.param_bytes[unit])
    shard = full / opt.shard_group_size
    return shard * (2 + s.opt_states) + full * s.compute_bytes / 4 * 2 + full


def base_levels(profile: ModelProfile, layout: Layout, s: Settings) -> np.ndarray:
    """Bytes at each event that belong to no unit's option: the prefix, the backward's extra, the loss."""
    base = np.zeros(len(layout.events))
    base[: layout.optimizer] = profile.prefix.at(s.micro_batch_size)
    for m in profile.modules:
        ev = layout.units[m.unit]
        extra = m.extra.at(s.micro_batch_size)
        base[ev.backward[m.key]] += extra
        if m.key == profile.by_unit[m.unit][-1].key:
            base[ev.backward_gather] += extra
        if m.key == profile.by_unit[m.unit][0].key:
            base[ev.reduce] += extra
    base[layout.loss] += profile.loss.at(s.micro_batch_size)
    if not s.gpu:
        base[layout.optimizer] += CPU_OPTIMIZER_TEMPS * profile.largest_param_bytes
    return base


def global_segments(layout: Layout, unit: str, fp: Footprint) -> Iterable[tuple[int, int, float]]:
    """A footprint's segments as event indices, its buffers at other units' events included."""
    for a, z, value in fp.segments:
        yield (*slot_range(layout, unit, a, z), value)
    for (a, z), value in (
        (layout.fw_buffer[unit], fp.fw_buffer),
        (layout.prefetch[unit], fp.prefetch),
        (layout.reduce_buffer[unit], fp.reduce_buffer),
    ):
        if value:
            yield a, z, value
    if fp.optimizer_temp:
        yield layout.optimizer, layout.optimizer, fp.optimizer_temp


def unit_segments(
    profile: ModelProfile, layout: Layout, unit: str, opt: Option, s: Settings, fp: Footprint | None = None
) -> Iterable[tuple[int, int, float]]:
    """Event ranges (first, last, bytes) where `unit` holds memory under `opt`: what `simulate` adds up
    and the exact search (milp.py) constrains, so the two cannot disagree. The root unit holds its
    bytes all step; `fp` is this unit's footprint under `opt` where the caller has it cached."""
    if unit not in layout.units:
        yield 0, len(layout.events) - 1, root_bytes(profile, unit, opt, s)
        return
    yield from global_segments(layout, unit, fp or footprint(profile, layout, unit, opt, s))


@dataclass
class Timeline:
    """Memory at every event, for the report's plot and for finding the peak."""

    events: list[tuple[str, float]] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(v for _, v in self.events)


def simulate(
    profile: ModelProfile,
    options: dict[str, Option],
    batch: int,
    compute_bytes: int = 4,
    optimizer: str = "adamw",
    accum: int = 1,
    gpu: bool = False,
    alone: bool = False,
) -> Timeline:
    """Per-rank bytes at each event of one steady-state step (after the first optimizer step); `alone`: a
    world of one (see Settings)."""
    layout = layout_of(profile)
    s = Settings(batch, accum, compute_bytes, ADAM_STATES if optimizer == "adamw" else 0, gpu, alone)
    levels = base_levels(profile, layout, s)
    diff = np.zeros(len(levels) + 1)
    for unit, opt in options.items():
        for a, z, value in unit_segments(profile, layout, unit, opt, s):
            if a <= z:
                diff[a] += value
                diff[z + 1] -= value
    levels = levels + np.cumsum(diff[:-1])
    return Timeline([(e.label, float(v)) for e, v in zip(layout.events, levels, strict=True)])
