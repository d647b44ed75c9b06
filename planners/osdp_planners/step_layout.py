"""The events of one training step under FSDP2, in order, for one model: each unit's all-gather and its
modules' forwards, the loss, each unit's backward gather, its modules' backwards and its reduce-scatter,
the optimizer step. Option-independent: the memory model (memory_model.py) says what each unit holds
between them, and the searches index their per-unit bounds by them.
"""

from dataclasses import dataclass
from functools import cached_property

from osdp_planners.profile import ModelProfile


@dataclass(frozen=True)
class Event:
    label: str
    owner: str | None  # the unit whose event it is; None for the loss and the optimizer step


@dataclass(frozen=True)
class UnitEvents:
    """Where one unit's own events sit in the step (indices into Layout.events)."""

    gather: int
    forward: dict[str, int]  # module path -> its forward
    backward_gather: int
    backward: dict[str, int]
    reduce: int

    @cached_property
    def anchors(self) -> list[int]:
        """Every own event, in order."""
        return sorted({self.gather, *self.forward.values(), self.backward_gather, *self.backward.values(), self.reduce})


@dataclass(frozen=True)
class Layout:
    """The step's events for one model (option-independent), and where each unit's buffers may live."""

    events: list[Event]
    units: dict[str, UnitEvents]
    loss: int
    optimizer: int
    fw_buffer: dict[str, tuple[int, int]]  # after its forward, until the next all-gather
    prefetch: dict[str, tuple[int, int]]  # its backward all-gather, issued by the unit before it
    reduce_buffer: dict[str, tuple[int, int]]  # after its reduce-scatter, until the next one

    @cached_property
    def slot_events(self) -> dict[str, tuple[list[int], list[int]]]:
        """Per unit, the first and the last event of each of its slots (see Footprint): the searches map
        every footprint segment of every unit through it, hundreds of thousands of times at 70B."""
        n = len(self.events)
        out = {}
        for unit, ev in self.units.items():
            anchors = ev.anchors
            slots = range(2 * len(anchors) + 1)
            first = [anchors[p // 2] if p % 2 else (anchors[p // 2 - 1] + 1 if p else 0) for p in slots]
            last = [
                anchors[p // 2] if p % 2 else (anchors[p // 2] - 1 if p // 2 < len(anchors) else n - 1) for p in slots
            ]
            out[unit] = (first, last)
        return out

    @classmethod
    def of(cls, profile: ModelProfile) -> "Layout":
        mods = profile.modules
        first: dict[str, str] = {}
        for m in mods:
            first.setdefault(m.unit, m.key)
        last = {m.unit: m.key for m in mods}
        events: list[Event] = []
        gather: dict[str, int] = {}
        forward: dict[str, dict[str, int]] = {}
        for m in mods:
            if m.key == first[m.unit]:
                gather[m.unit] = len(events)
                events.append(Event(f"{m.unit} all-gather", m.unit))
            forward.setdefault(m.unit, {})[m.key] = len(events)
            events.append(Event(f"{m.key} forward", m.unit))
        loss = len(events)
        events.append(Event("loss", None))
        bw_gather: dict[str, int] = {}
        backward: dict[str, dict[str, int]] = {}
        reduce: dict[str, int] = {}
        for m in reversed(mods):
            if m.key == last[m.unit]:
                bw_gather[m.unit] = len(events)
                events.append(Event(f"{m.unit} backward gather", m.unit))
            backward.setdefault(m.unit, {})[m.key] = len(events)
            events.append(Event(f"{m.key} backward", m.unit))
            if m.key == first[m.unit]:
                reduce[m.unit] = len(events)
                events.append(Event(f"{m.unit} reduce-scatter", m.unit))
        optimizer = len(events)
        events.append(Event("optimizer step", None))
        units = {u: UnitEvents(gather[u], forward[u], bw_gather[u], backward[u], reduce[u]) for u in gather}
        gathers = sorted(gather.values())
        fw_buffer = {}
        for u, ev in units.items():
            end = max(ev.forward.values())
            nxt = next((g for g in gathers if g > end), loss)
            fw_buffer[u] = (end + 1, min(nxt, loss - 1))
        by_bw = sorted(units, key=lambda u: bw_gather[u])
        prefetch = {u: (bw_gather[by_bw[i - 1]], bw_gather[u] - 1) if i else (1, 0) for i, u in enumerate(by_bw)}
        by_reduce = sorted(units, key=lambda u: reduce[u])
        reduce_buffer = {
            u: (reduce[u] + 1, reduce[by_reduce[i + 1]] - 1 if i + 1 < len(by_reduce) else optimizer - 1)
            for i, u in enumerate(by_reduce)
        }
        return cls(events, units, loss, optimizer, fw_buffer, prefetch, reduce_buffer)


def slot_range(layout: Layout, unit: str, a: int, z: int) -> tuple[int, int]:
    """Event indices (first, last) of the slots a..z of `unit` (see Footprint); first > last: none."""
    first, last = layout.slot_events[unit]
    return first[a], last[z]


_LAYOUTS: dict[int, tuple[ModelProfile, Layout]] = {}


def layout_of(profile: ModelProfile) -> Layout:
    """The profile's event layout, built once per profile."""
    cached = _LAYOUTS.get(id(profile))
    if cached is None or cached[0] is not profile:
        cached = (profile, Layout.of(profile))
        _LAYOUTS[id(profile)] = cached
    return cached[1]
