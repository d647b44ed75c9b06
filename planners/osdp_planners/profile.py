"""A model's profile: per unit, activation memory over the step's timeline and FLOPs, batch-linear.

What the memory and time models read (profiler.py measures it). Sharding does not change
activations, so the memory model adds FSDP2's own memory on top of what is profiled. Operator
splitting and activation checkpointing do change them, so there are readings per variant (every
unit split k ways and/or checkpointed): a unit's readings under the variant its option picks are
taken from that variant. Every reading is measured at two batch sizes and fitted as a + b * batch
(exact for transformers, whose activations scale with the batch), or as the maximum of such lines.

Readings are per module, relative to the module itself, so that units can be mixed:
- keep: bytes that stay alive from the module's start until the next module starts (what its
  backward needs, and whatever the code between modules creates and keeps);
- fw_peak: the most bytes above the level at its start during its forward;
- bw_peak / bw_post: the most bytes above the level at its backward's start during its backward
  (recomputation included), and the change by its end (its gradients still held, see recorder.py).
Option-independent levels come from the plain run: `prefix` (alive before the first module),
`extra` per module (alive at its backward's start beyond every kept byte: the gradient flowing back,
gradients of groups not reduced yet) and `loss` (beyond every kept byte, from the logits to the
first module's backward).
"""

import difflib
from dataclasses import dataclass
from functools import cached_property

from osdp_planners.options import SPLITS, Variant
from osdp_planners.trace import ROOT
from osdp_planners.units import Unit

PROFILE_BATCHES = (2, 4)  # the micro batches every reading is measured at


@dataclass(frozen=True)
class Linear1:
    """a + b * batch."""

    a: float
    b: float

    def at(self, batch: int) -> float:
        return self.a + self.b * batch

    @classmethod
    def fit(cls, v1: float, v2: float, b1: int, b2: int) -> "Linear1":
        slope = (v2 - v1) / (b2 - b1)
        return cls(v1 - slope * b1, slope)


@dataclass(frozen=True)
class Peak:
    """The most bytes over a stretch of the step, as a function of the batch: the maximum of lines.

    Every op's live bytes are linear in the batch (activations scale with it, parameters and their
    gradients do not), but which op holds the most depends on the batch: a peak is convex, not a line.
    Two runs at different batches give each op's line; the peak keeps those on the upper envelope.
    """

    lines: tuple[Linear1, ...]

    def at(self, batch: int) -> float:
        return max(line.at(batch) for line in self.lines)

    @classmethod
    def of(cls, first: tuple[list[float], list[str]], second: tuple[list[float], list[str]], base: Linear1) -> "Peak":
        """The envelope for batches >= 1 of the ops' lines (the two runs' stretches, op by op), less `base`."""
        b1, b2 = PROFILE_BATCHES
        lines = {Linear1.fit(v1 - base.at(b1), v2 - base.at(b2), b1, b2) for v1, v2 in _aligned(first, second)}
        envelope: list[Linear1] = []
        batch = 1.0
        current = max(lines, key=lambda ln: (ln.at(1), ln.b))
        while True:
            envelope.append(current)
            steeper = [(ln.a - current.a) / (current.b - ln.b) for ln in lines if ln.b > current.b]
            crossings = [
                (x, ln) for x, ln in zip(steeper, (ln for ln in lines if ln.b > current.b), strict=True) if x >= batch
            ]
            if not crossings:
                return cls(tuple(envelope))
            batch, current = min(crossings, key=lambda c: (c[0], -c[1].b))


def _aligned(first: tuple[list[float], list[str]], second: tuple[list[float], list[str]]) -> list[tuple[float, float]]:
    """Pairs of readings of the same op in two runs. The runs execute the same ops, except where a
    decomposition depends on the shape: then the ops both ran are matched, and each run's largest
    reading of the rest is paired with the other's, so a peak among them is not lost."""
    (v1, ops1), (v2, ops2) = first, second
    if ops1 == ops2:
        return list(zip(v1, v2, strict=True))
    pairs: list[tuple[float, float]] = []
    left1, left2 = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ops1, b=ops2, autojunk=False).get_opcodes():
        if tag == "equal":
            pairs += zip(v1[i1:i2], v2[j1:j2], strict=True)
        else:
            left1 += v1[i1:i2]
            left2 += v2[j1:j2]
    if left1 or left2:
        pairs.append((max(left1, default=max(v1)), max(left2, default=max(v2))))
    return pairs


PLAIN = Variant()
VARIANTS = tuple(Variant(k, c) for k in SPLITS for c in (False, True))


@dataclass(frozen=True)
class Activations:
    """One module's activation readings under one variant (see the module docstring)."""

    keep: Linear1
    fw_peak: Peak
    bw_peak: Peak
    bw_post: Linear1
    # the backward's peak had its split slices' gradients stayed whole after their reduce-scatter:
    # FSDP2 keeps a 1/group shard of each, so the option's peak lies between the two (memory_model.py)
    bw_unreduced: Peak


@dataclass(frozen=True)
class ModuleProfile:
    """One forward call of a unit's module: a module run twice has two, told apart by `key`."""

    key: str  # recorder.call_key: the path, or path#k for its k-th call
    path: str
    unit: str
    variants: dict[Variant, Activations]
    extra: Linear1  # option-independent bytes at its backward's start (plain run)
    fwd_flops: Linear1  # backward is taken as 2x forward (two matmuls per forward matmul)


@dataclass(frozen=True)
class LinearShape:
    """A Linear an operator split would slice: its bytes (fp32), rows and parameter tensors."""

    path: str
    param_bytes: int
    out_features: int
    tensors: int

    def within(self, module: str) -> bool:
        """The Linear is the module at `module`, or inside it."""
        return self.path == module or self.path.startswith(f"{module}.")

    def slice_bytes(self, k: int) -> float:
        """Bytes of the widest of its k slices (slices differ by at most one row)."""
        return self.param_bytes / self.out_features * -(-self.out_features // k)


@dataclass(frozen=True)
class ModelProfile:
    units: list[Unit]
    modules: list[ModuleProfile]  # in forward execution order
    param_bytes: dict[str, int]  # unit -> fp32 bytes of its parameters
    linears: dict[str, list[LinearShape]]  # unit -> the Linears a split would slice
    largest_param_bytes: int  # fp32 bytes of the largest parameter tensor (optimizer temporaries)
    prefix: Linear1
    loss: Peak
    outside_flops: Linear1  # the model's forward outside every unit module (the root unit's work)

    @cached_property
    def by_unit(self) -> dict[str, list[ModuleProfile]]:
        """Each unit's modules, so per-unit costs do not rescan the whole model."""
        out: dict[str, list[ModuleProfile]] = {}
        for m in self.modules:
            out.setdefault(m.unit, []).append(m)
        return out

    def forward_flops(self, unit: str, batch: int) -> float:
        """A unit's forward FLOPs at a micro batch; the root also does the work outside every unit."""
        flops = sum(m.fwd_flops.at(batch) for m in self.by_unit.get(unit, []))
        return flops + (self.outside_flops.at(batch) if unit == ROOT else 0.0)

    @cached_property
    def tensor_count(self) -> dict[str, int]:
        return {u.name: u.tensor_count for u in self.units}

    @cached_property
    def linear_bytes(self) -> dict[str, list[int]]:
        return {u: [lin.param_bytes for lin in lins] for u, lins in self.linears.items()}

    @cached_property
    def linear_tensors(self) -> dict[str, list[int]]:
        return {u: [lin.tensors for lin in lins] for u, lins in self.linears.items()}
