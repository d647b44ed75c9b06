"""The cost model in one place: a plan's per-rank peak memory, step time and throughput.

`Context` holds what does not change during a search (profile, measured times, topology, dtypes);
`evaluate` gives the numbers a plan is judged and reported by (memory from the event simulation);
`Bound` gives the knapsack search its decomposable view of the same memory (see search.py):
at any event, every unit holds at most its `resident` bytes (the most it holds at other units'
events), so the peak is at most the sum of residents plus, over the events of one unit, what
that unit holds beyond its resident, the option-independent base, and the most its neighbours'
buffers can add there.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from osdp_planners.compute_probe import MeasuredTimes
from osdp_planners.explanation import UnitSeconds
from osdp_planners.memory_model import (
    ADAM_STATES,
    Footprint,
    Settings,
    Timeline,
    base_levels,
    footprint,
    root_bytes,
    simulate,
)
from osdp_planners.options import Option
from osdp_planners.profile import ModelProfile
from osdp_planners.search import Candidate
from osdp_planners.step_layout import Layout, layout_of, slot_range
from osdp_planners.time_model import Topology, optimizer_seconds, unit_time


@dataclass(frozen=True)
class Context:
    profile: ModelProfile
    topo: Topology
    measured: MeasuredTimes | None
    compute_bytes: int  # 2 under bf16 mixed precision, else 4
    optimizer: str
    usable_memory_bytes: float  # the budget less the margin (PlanRequest.usable_memory_bytes): what a plan may reach

    @property
    def overlap(self) -> bool:
        return self.topo.device.accelerator == "gpu"

    @property
    def alone(self) -> bool:
        """A world of one runs no FSDP2 (runtime.apply): see memory_model.Settings."""
        return self.topo.world_size == 1

    @property
    def opt_states(self) -> int:
        return ADAM_STATES if self.optimizer == "adamw" else 0

    @cached_property
    def layout(self) -> Layout:
        return layout_of(self.profile)

    def settings(self, batch: int, accum: int) -> Settings:
        return Settings(batch, accum, self.compute_bytes, self.opt_states, self.overlap, self.alone)

    @cached_property
    def signatures(self) -> dict[str, tuple[object, ...]]:
        """Per unit, a small key equal for identical units: the shape and profile it is built from,
        numbered (hashing the nested profile on every lookup would cost seconds at 70B); once per
        context, since every Bound and evaluate() asks."""
        p = self.profile
        numbers: dict[tuple[object, ...], int] = {}
        out: dict[str, tuple[object, ...]] = {}
        for u, mods in p.by_unit.items():
            lins = tuple(
                (lin.param_bytes, lin.out_features, next(i for i, m in enumerate(mods) if lin.within(m.path)))
                for lin in p.linears.get(u, [])
            )
            shape = (
                p.param_bytes[u],
                lins,
                tuple(tuple(sorted(m.variants.items(), key=lambda kv: (kv[0].split, kv[0].checkpoint))) for m in mods),
            )
            out[u] = ("class", numbers.setdefault(shape, len(numbers)))
        return out


@dataclass(frozen=True)
class Evaluation:
    peak_bytes: float
    step_time_s: float
    throughput: float  # samples per second
    unit_seconds: dict[str, UnitSeconds]
    unit_resident: dict[str, float]
    timeline: Timeline


def _slot_values(fp: Footprint, slots: int) -> np.ndarray:
    """A footprint's bytes per slot (see memory_model.Footprint)."""
    diff = np.zeros(slots + 1)
    for a, z, value in fp.segments:
        diff[a] += value
        diff[z + 1] -= value
    return np.cumsum(diff[:-1])


class Bound:
    """The search's per-unit memory view at one batch size (see the module docstring)."""

    def __init__(self, ctx: Context, batch: int, accum: int) -> None:
        self.ctx = ctx
        self.settings = ctx.settings(batch, accum)
        layout = ctx.layout
        self.base = base_levels(ctx.profile, layout, self.settings)
        self._footprints: dict[tuple[object, ...], Footprint] = {}
        self._matrices: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.neighbours = np.zeros(len(layout.events) + 1)

    def footprint(self, unit: str, opt: Option) -> Footprint:
        """Identical units share footprints: they depend on the unit's shape and profile, not its place."""
        key = (self.signature(unit), opt)
        if key not in self._footprints:
            self._footprints[key] = footprint(self.ctx.profile, self.ctx.layout, unit, opt, self.settings)
        return self._footprints[key]

    def signature(self, unit: str) -> tuple[object, ...]:
        return self.ctx.signatures.get(unit, (unit,))  # the root runs no module of its own: it is unique

    def add_neighbour_buffers(self, options: dict[str, list[Option]]) -> None:
        """The most each unit's buffers can add at other units' events, over the options it may take."""
        layout = self.ctx.layout
        for unit, opts in options.items():
            if unit not in layout.units:
                continue
            fps = [self.footprint(unit, o) for o in opts]
            for (a, z), value in (
                (layout.fw_buffer[unit], max(f.fw_buffer for f in fps)),
                (layout.prefetch[unit], max(f.prefetch for f in fps)),
                (layout.reduce_buffer[unit], max(f.reduce_buffer for f in fps)),
                ((layout.optimizer, layout.optimizer), max(f.optimizer_temp for f in fps)),
            ):
                if value and a <= z:
                    self.neighbours[a] += value
                    self.neighbours[z + 1] -= value

    @cached_property
    def context_levels(self) -> np.ndarray:
        """Base plus neighbours' worst buffers at every event (call add_neighbour_buffers first)."""
        return self.base + np.cumsum(self.neighbours[:-1])

    def _slot_matrix(self, unit: str, options: tuple[Option, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per option, its bytes in every slot, and its resident (the most at other units' events)."""
        key = (self.signature(unit), options)
        if key not in self._matrices:
            slots = 2 * len(self.ctx.layout.units[unit].anchors) + 1
            values = np.stack([_slot_values(self.footprint(unit, o), slots) for o in options])
            gaps = [s for s in range(0, slots, 2) if _nonempty(self.ctx.layout, unit, s)]
            resident = values[:, gaps].max(axis=1) if gaps else np.zeros(len(options))
            self._matrices[key] = (values, np.maximum(resident, 0.0))
        return self._matrices[key]

    def memory_rows(self, unit: str, options: list[Option]) -> np.ndarray:
        """Per option, what it holds in each slot of its unit and in each buffer it leaves at other
        units' events: one option holds no more than another at every event of the step if and only
        if its row is no larger everywhere (the root holds one amount all step)."""
        if unit not in self.ctx.layout.units:
            return np.array([[root_bytes(self.ctx.profile, unit, o, self.settings)] for o in options])
        values, _ = self._slot_matrix(unit, tuple(options))
        fps = [self.footprint(unit, o) for o in options]
        buffers = np.array([[f.fw_buffer, f.prefetch, f.reduce_buffer, f.optimizer_temp] for f in fps])
        return np.hstack([values, buffers])

    def candidates(self, unit: str, options: list[Option], times: list[float]) -> list[Candidate]:
        """The knapsack's view of `unit`'s options (call add_neighbour_buffers first)."""
        if unit not in self.ctx.layout.units:  # the root: what it holds, it holds all step
            return [
                Candidate(root_bytes(self.ctx.profile, unit, o, self.settings), 0.0, t)
                for o, t in zip(options, times, strict=True)
            ]
        values, resident = self._slot_matrix(unit, tuple(options))
        own = (values[:, 1::2] + self.context_levels[self.ctx.layout.units[unit].anchors][None, :]).max(axis=1)
        return [Candidate(float(r), float(o - r), t) for r, o, t in zip(resident, own, times, strict=True)]

    def global_transient(self) -> float:
        """What the loss and the optimizer step add beyond every unit's resident bytes."""
        layout = self.ctx.layout
        return float(max(self.context_levels[layout.loss], self.context_levels[layout.optimizer]))


def _nonempty(layout: Layout, unit: str, slot: int) -> bool:
    a, z = slot_range(layout, unit, slot, slot)
    return a <= z


def unit_parts(ctx: Context, unit: str, opt: Option, batch: int, accum: int) -> UnitSeconds:
    """One unit's seconds per step by part: communication counts where compute does not hide it."""
    t = unit_time(ctx.profile, unit, opt, batch, ctx.topo, ctx.measured, ctx.compute_bytes, ctx.overlap)
    optimizer = optimizer_seconds(ctx.profile, {unit: opt}, ctx.topo, ctx.measured)
    return UnitSeconds(accum * t.compute_s, accum * (t.total_s - t.compute_s), optimizer)


def unit_seconds(ctx: Context, unit: str, opt: Option, batch: int, accum: int) -> float:
    return unit_parts(ctx, unit, opt, batch, accum).total_s


def evaluate(ctx: Context, options: dict[str, Option], batch: int, accum: int) -> Evaluation:
    timeline = simulate(ctx.profile, options, batch, ctx.compute_bytes, ctx.optimizer, accum, ctx.overlap, ctx.alone)
    parts = {u: unit_parts(ctx, u, o, batch, accum) for u, o in options.items()}
    step = sum(p.total_s for p in parts.values()) + accum * ctx.topo.step_fixed_s
    samples = batch * accum * ctx.topo.world_size
    bound = Bound(ctx, batch, accum)
    resident = {u: bound.candidates(u, [o], [0.0])[0].resident for u, o in options.items()}
    return Evaluation(timeline.peak, step, samples / step, parts, resident, timeline)
