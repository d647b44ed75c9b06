"""Per-unit profile of a model: activation memory over the step's timeline and FLOPs, batch-linear.

The model runs unsharded, in one process, on fake tensors (no memory, any size), under a recorder
of live tensor bytes (see recorder.py). Sharding does not change activations, so the memory model
adds FSDP2's own memory on top of what is profiled here. Operator splitting and activation
checkpointing do change them, so the model is run once per variant (every unit split k ways
and/or checkpointed, exactly as the runtime applies them): a unit's readings under the variant its
option picks are then taken from that run. Every reading is measured at two batch sizes and fitted
as a + b * batch (exact for transformers, whose activations scale with the batch).

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from osdp_planners.fake_build import build_fake
from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.options import SPLITS
from osdp_planners.recorder import Recorder
from osdp_planners.split import SplitLinear, linear_at, split_linear_in
from osdp_planners.torch_private import FakeTensorMode, checkpoint
from osdp_planners.trace import ROOT, CallTrace, trace_calls
from osdp_planners.units import Unit, units_of

PROFILE_BATCHES = (2, 4)
KEEP_BLOCKS = 2


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


@dataclass(frozen=True)
class Variant:
    """How a unit's modules run: Linears split `split` ways, activations checkpointed or not."""

    split: int = 1
    checkpoint: bool = False


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


@dataclass(frozen=True)
class _Run:
    """One forward+backward: per module its four levels and the trace stretches of its forward and
    backward, FLOPs, the live bytes after every op, and the loss region's stretch."""

    order: list[str]
    levels: dict[str, dict[str, float]]
    spans: dict[str, dict[str, tuple[int, int]]]
    flops: dict[str, float]
    outside_flops: float
    trace: list[float]
    reduced: list[float]
    ops: list[str]
    end_of_forward: float
    loss: tuple[int, int]

    def stretch(self, span: tuple[int, int]) -> tuple[list[float], list[str]]:
        return self.trace[span[0] : span[1] + 1], self.ops[span[0] : span[1] + 1]

    def stretch_unreduced(self, span: tuple[int, int]) -> tuple[list[float], list[str]]:
        """The stretch as if the split slices' gradients reduced within it had stayed whole."""
        values, ops = self.stretch(span)
        start = self.reduced[span[0]]
        return [v + r - start for v, r in zip(values, self.reduced[span[0] : span[1] + 1], strict=True)], ops


def _grad_groups(model: nn.Module, units: list[Unit]) -> tuple[dict[nn.Module, list[nn.Parameter]], list[nn.Parameter]]:
    """FSDP2's gradient groups, keyed by the module whose post-backward reduces them (a unit's
    parameters are reduced at its first module's), and the parameters of split slices: each slice is
    a group of its own, reduced as soon as its backward ends (FSDP2 hooks each slice's own inputs;
    slices share their input, so waiting for the input's whole gradient would hold them too long)."""
    groups: dict[nn.Module, list[nn.Parameter]] = {}
    slices: list[nn.Parameter] = []
    for u in units:
        if u.name == ROOT:
            continue
        taken: set[int] = set()
        for path in u.modules:
            for sub in model.get_submodule(path).modules():
                if isinstance(sub, SplitLinear):
                    for piece in sub.slices:
                        slices += piece.parameters()
                        taken |= {id(p) for p in piece.parameters()}
        first = model.get_submodule(u.modules[0])
        rest = [p for path in u.modules for p in model.get_submodule(path).parameters() if id(p) not in taken]
        groups.setdefault(first, []).extend(rest)
    return groups, slices


def _run_once(
    model: nn.Module, units: list[Unit], modules: dict[str, str], batch: int, seq_len: int, vocab: int
) -> _Run:
    groups, slices = _grad_groups(model, units)
    recorder = Recorder({model.get_submodule(p): p for p in modules}, model, groups)

    def reduced(param: torch.Tensor) -> None:
        if param.grad is not None:
            recorder.reduce(param.grad)
        param.grad = None

    handles = [p.register_post_accumulate_grad_hook(reduced) for p in slices]
    x = torch.randint(0, vocab, (batch, seq_len))
    with recorder.active():
        logits = logits_of(model(x))
        end_of_forward = recorder.live
        recorder.open_region("loss")  # the loss, and log-softmax's backward: its output, input and output grads
        loss = lm_loss(logits, x)
        del logits
        loss.backward()
    for h in handles:
        h.remove()
    readings = recorder.readings
    return _Run(
        recorder.order,
        {k: dict(r.values) for k, r in readings.items()},
        {k: dict(r.spans) for k, r in readings.items()},
        {k: r.flops for k, r in readings.items()},
        recorder.outside.flops,
        recorder.trace,
        recorder.reduced_trace,
        recorder.ops,
        float(end_of_forward),
        recorder.regions["loss"],
    )


def _signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def _runs_in_order(list_path: str, n: int, trace: CallTrace, tracked: set[str]) -> bool:
    """The blocks of the list run once each, in order, with no other unit module between them."""
    prefix = f"{list_path}."
    calls = [p for p in trace.sequence if p in tracked]
    inside = [i for i, p in enumerate(calls) if p.startswith(prefix)]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return False
    blocks = [int(calls[i][len(prefix) :].split(".")[0]) for i in inside]
    mods = [calls[i] for i in inside]
    return blocks == sorted(blocks) and len(set(mods)) == len(mods) and set(blocks) == set(range(n))


def _truncate_repeats(model: nn.Module, trace: CallTrace, tracked: set[str]) -> tuple[str, int] | None:
    """Cut the longest list of identical blocks to KEEP_BLOCKS; the rest are extrapolated from them.

    Fake-tensor dispatch costs about a millisecond per op, so a 70B model would take minutes to
    trace; identical blocks record identical readings relative to their own start. Only lists whose
    blocks run once each, one after the other, are cut.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for path, mod in model.named_modules():
        if (
            isinstance(mod, nn.ModuleList)
            and len(mod) > KEEP_BLOCKS
            and len({_signature(b) for b in mod}) == 1
            and (best is None or len(mod) > len(best[1]))
            and _runs_in_order(path, len(mod), trace, tracked)
        ):
            best = (path, mod)
    if best is None:
        return None
    path, blocks = best
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, nn.ModuleList(list(blocks)[:KEEP_BLOCKS]))
    return path, len(blocks)


def _full_order(order: list[str], blocks: tuple[str, int] | None) -> list[tuple[str, str]]:
    """(module path in the full model, path it was profiled as) in forward order: the last profiled
    block stands for every block after it."""
    if blocks is None:
        return [(p, p) for p in order]
    list_path, n = blocks
    prefix = f"{list_path}.{KEEP_BLOCKS - 1}"
    tail = [p for p in order if p == prefix or p.startswith(f"{prefix}.")]
    at = order.index(tail[0]) if tail else len(order)
    repeated = [(f"{list_path}.{i}{p[len(prefix) :]}", p) for i in range(KEEP_BLOCKS - 1, n) for p in tail]
    return [(p, p) for p in order[:at]] + repeated + [(p, p) for p in order[at + len(tail) :]]


def _apply_variant(model: nn.Module, units: list[Unit], variant: Variant, live: set[str]) -> None:
    """Split and checkpoint every unit's modules as the runtime would (platform/osdp_platform/runtime/apply.py)."""
    for u in units:
        if u.name == ROOT:
            continue
        if variant.split > 1:
            for path in u.linears:
                if path in live:
                    split_linear_in(model, path, min(variant.split, linear_at(model, path).out_features))
        if variant.checkpoint:
            for path in u.modules:
                if path in live:
                    checkpoint(model.get_submodule(path))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def _variant_runs(
    build: Callable[[str], nn.Module], seq_len: int, vocab: int, dtype: torch.dtype, variants: tuple[Variant, ...]
) -> tuple[list[Unit], dict[str, str], dict[Variant, list[_Run]], tuple[str, int] | None, nn.Module]:
    runs: dict[Variant, list[_Run]] = {}
    units: list[Unit] = []
    unit_of: dict[str, str] = {}
    blocks: tuple[str, int] | None = None
    full: nn.Module | None = None
    trace = CallTrace()
    for variant in variants:
        with _default_dtype(dtype):
            model = build_fake(lambda: build("cpu"))
        if full is None:
            full = model
            trace = trace_calls(model, seq_len, vocab)
            units = units_of(model, trace)
            unit_of = {m: u.name for u in units for m in u.modules if m}
            with _default_dtype(dtype):
                model = build_fake(lambda: build("cpu"))
        blocks = _truncate_repeats(model, trace, set(unit_of))
        live = {path for path, _ in model.named_modules()}
        present = [u for u in units if all(m in live for m in u.modules)]
        _apply_variant(model, present, variant, live)
        modules = {m: u for m, u in unit_of.items() if m in live}
        runs[variant] = [_run_once(model, present, modules, b, seq_len, vocab) for b in PROFILE_BATCHES]
    assert full is not None
    return units, unit_of, runs, blocks, full


def _fit(values: list[float]) -> Linear1:
    (b1, b2), (v1, v2) = PROFILE_BATCHES, values
    return Linear1.fit(v1, v2, b1, b2)


def _kept(run: _Run) -> dict[str, float]:
    """Per profiled module, what stays alive from its start until the next module starts."""
    starts = [run.levels[p]["pre_fw"] for p in run.order] + [run.end_of_forward]
    return {p: starts[i + 1] - starts[i] for i, p in enumerate(run.order)}


def _activations(runs: list[_Run]) -> dict[str, Activations]:
    """Per profiled module, its readings relative to itself under one variant."""
    kept = [_kept(r) for r in runs]

    def fit(fn: Callable[[_Run, dict[str, float]], float]) -> Linear1:
        return _fit([fn(r, k) for r, k in zip(runs, kept, strict=True)])

    def peak(p: str, phase: str, unreduced: bool = False) -> Peak:
        first, second = ((r.stretch_unreduced if unreduced else r.stretch)(r.spans[p][phase]) for r in runs)
        return Peak.of(first, second, _fit([r.levels[p][f"pre_{phase}"] for r in runs]))

    split = any(r.reduced[-1] for r in runs)  # without split slices nothing is reduced early

    def activations(p: str) -> Activations:
        bw = peak(p, "bw")
        return Activations(
            keep=fit(lambda _r, k: k[p]),
            fw_peak=peak(p, "fw"),
            bw_peak=bw,
            bw_post=fit(lambda r, _k: r.levels[p]["post_bw"] - r.levels[p]["pre_bw"]),
            bw_unreduced=peak(p, "bw", unreduced=True) if split else bw,
        )

    return {p: activations(p) for p in runs[0].order}


def _extras(run: _Run) -> tuple[dict[str, float], float, float]:
    """Option-independent levels of the plain run: per module at its backward's start, the prefix,
    and every byte the modules keep (the loss region's peak is taken beyond it)."""
    kept = _kept(run)
    prefix = run.levels[run.order[0]]["pre_fw"]
    extra, total = {}, prefix
    for p in run.order:
        total += kept[p]
        extra[p] = run.levels[p]["pre_bw"] - total
    return extra, prefix, total


def profile_model(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    variants: tuple[Variant, ...] = VARIANTS,
) -> ModelProfile:
    """Profile `build("cpu")` (constructed inside fake mode, so any size works) under every variant.

    `dtype` is the compute dtype: under bf16 mixed precision activations (and the unsharded
    gradients FSDP2 holds) are bf16.
    """
    with FakeTensorMode():
        units, unit_of, runs, blocks, full = _variant_runs(
            build, seq_len, vocab_size, dtype, tuple(dict.fromkeys((PLAIN, *variants)))
        )
        linears = {u.name: [_linear_shape(full, p) for p in u.linears] for u in units}
        largest = max((4 * p.numel() for p in full.parameters()), default=0)
    plain = runs[PLAIN]
    acts = {v: _activations(rs) for v, rs in runs.items()}
    extras = [_extras(r) for r in plain]
    modules = [
        ModuleProfile(
            key,
            key.partition("#")[0],
            unit_of[key.partition("#")[0]],
            {v: a[profiled] for v, a in acts.items()},
            _fit([e[0][profiled] for e in extras]),
            _fit([r.flops[profiled] for r in plain]),
        )
        for key, profiled in _full_order(plain[0].order, blocks)
    ]
    prefix = _fit([e[1] for e in extras])
    first, second = (r.stretch(r.loss) for r in plain)
    loss = Peak.of(first, second, _fit([e[2] for e in extras]))
    param_bytes = {u.name: 4 * u.param_count for u in units}
    outside = _fit([r.outside_flops for r in plain])
    return ModelProfile(units, modules, param_bytes, linears, largest, prefix, loss, outside)


def _linear_shape(model: nn.Module, path: str) -> LinearShape:
    linear = linear_at(model, path)
    params = list(linear.parameters())
    return LinearShape(path, 4 * sum(p.numel() for p in params), linear.out_features, len(params))
