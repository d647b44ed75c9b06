"""How a model's profile (profile.py) is measured: the model runs unsharded, in one process, on fake
tensors (no memory, any size), under a recorder of live tensor bytes (recorder.py), once per variant,
each split and checkpointed exactly as the runtime applies them, at the two batch sizes of
PROFILE_BATCHES. Of a list of identical blocks only KEEP_BLOCKS run; the rest are extrapolated.

A model small enough runs its variants on real CPU tensors instead: the recorder counts the storages
the ops return, which are the same ops with the same shapes either way, and a small model's kernels
cost less than fake tensors' dispatch (about 0.1 ms an op), so its profile takes half the time.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from osdp_planners import run_tensors
from osdp_planners.errors import UserError
from osdp_planners.fake_build import build_fake
from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.options import Variant
from osdp_planners.profile import (
    PLAIN,
    PROFILE_BATCHES,
    VARIANTS,
    Activations,
    Linear1,
    LinearShape,
    ModelProfile,
    ModuleProfile,
    Peak,
)
from osdp_planners.recorder import Recorder
from osdp_planners.split import SplitLinear, linear_at, split_linear_in
from osdp_planners.torch_private import FakeTensorMode, checkpoint
from osdp_planners.trace import ROOT, CallTrace, bf16_only, fp32_refused, trace_calls
from osdp_planners.units import Unit, units_of

KEEP_BLOCKS = 2


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
    """The model built once on fake tensors for its call trace and units, then once per variant and run.

    The plain variant runs on fake tensors. A small model runs the others on real ones if its plain run
    records there exactly what it recorded on fake tensors: a few ops decompose by device (CPU dropout
    keeps a float noise tensor where fake tensors, as CUDA, keep a bool mask), and a model may use a
    kernel that only fake tensors have.
    """
    with FakeTensorMode():
        with _default_dtype(dtype):
            full = build_fake(lambda: build("cpu"))
        try:
            trace = trace_calls(full, seq_len, vocab)
        except UserError as exc:
            if not bf16_only(full, seq_len, vocab):
                raise
            raise fp32_refused(exc) from exc
    units = units_of(full, trace)
    unit_of = {m: u.name for u in units for m in u.modules if m}

    def run(variant: Variant, real: bool) -> tuple[list[_Run], tuple[str, int] | None]:
        with run_tensors.tensors(real):
            with _default_dtype(dtype):
                model = build("cpu") if real else build_fake(lambda: build("cpu"))
            blocks = _truncate_repeats(model, trace, set(unit_of))
            live = {path for path, _ in model.named_modules()}
            present = [u for u in units if all(m in live for m in u.modules)]
            _apply_variant(model, present, variant, live)
            modules = {m: u for m, u in unit_of.items() if m in live}
            return [_run_once(model, present, modules, b, seq_len, vocab) for b in PROFILE_BATCHES], blocks

    plain, blocks = run(PLAIN, real=False)
    real = False
    if run_tensors.small_enough(full, seq_len):
        try:
            real = run(PLAIN, real=True)[0] == plain
        except (RuntimeError, NotImplementedError):
            real = False
    runs = {PLAIN: plain} | {v: run(v, real)[0] for v in variants if v != PLAIN}
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
    """Profile `build("cpu")` (constructed inside fake mode, so any size works; a small model on real
    tensors where they record the same) under every variant.

    `dtype` is the compute dtype: under bf16 mixed precision activations (and the unsharded
    gradients FSDP2 holds) are bf16.
    """
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
