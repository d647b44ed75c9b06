"""Per-unit profile of a model: activation memory over the step's timeline and FLOPs, batch-linear.

The model runs unsharded, in one process, on fake tensors (no memory, any size), under a recorder
of live tensor bytes: for every unit module it records the activation + temporary bytes live
before, at the peak of and after its forward and its backward. Sharding does not change activations, so the cost
model adds FSDP2's own memory on top of this timeline. Everything is measured at two batch sizes and
fitted as a + b * batch (exact for transformers, whose activations scale with the batch).
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.recorder import POINTS, Recorder
from osdp_planners.trace import ROOT, CallTrace, trace_calls
from osdp_planners.units import Unit, units_of

PROFILE_BATCHES = (1, 2)


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
class ModuleProfile:
    """Activation bytes (all units' activations live at that moment) at six points of one module."""

    path: str
    unit: str
    pre_fw: Linear1
    peak_fw: Linear1
    post_fw: Linear1
    pre_bw: Linear1
    peak_bw: Linear1  # includes the module's own parameter gradients live at that peak
    post_bw: Linear1
    output: Linear1  # bytes of the module's output (kept by a checkpointed unit)
    fwd_flops: Linear1  # backward is taken as 2x forward (two matmuls per forward matmul)


@dataclass(frozen=True)
class ModelProfile:
    units: list[Unit]
    modules: list[ModuleProfile]  # in forward execution order
    param_bytes: dict[str, int]  # unit -> fp32 bytes of its parameters
    linear_bytes: dict[str, list[int]]  # unit -> fp32 bytes of each Linear a split would slice
    linear_tensors: dict[str, list[int]]  # unit -> parameter tensors of each of those Linears
    peak_loss: Linear1  # activation bytes at the peak from the last forward to the first module's backward

    @cached_property
    def by_unit(self) -> dict[str, list[ModuleProfile]]:
        """Each unit's modules, so per-unit costs do not rescan the whole model."""
        out: dict[str, list[ModuleProfile]] = {}
        for m in self.modules:
            out.setdefault(m.unit, []).append(m)
        return out

    @cached_property
    def tensor_count(self) -> dict[str, int]:
        return {u.name: u.tensor_count for u in self.units}


Entry = tuple[str, dict[str, float]]  # a module call: its path and readings


def _run_once(model: nn.Module, modules: set[str], batch: int, seq_len: int, vocab: int, root: bool
              ) -> tuple[list[Entry], float]:
    """One forward+backward; returns one entry per unit-module call in execution order, and the
    loss-region peak. With `root`, the root's own forward work comes first as an entry of no width."""
    # drop each gradient once accumulated: FSDP2 frees unsharded grads at every unit's post-backward,
    # so only the running unit's grads coexist with its backward activations, as here
    recorder = Recorder({model.get_submodule(p): p for p in modules}, model)

    def drop_grad(param: torch.Tensor) -> None:
        if param.grad is not None:
            recorder.forget(param.grad)
        param.grad = None

    handles = [p.register_post_accumulate_grad_hook(drop_grad) for p in model.parameters()]
    x = torch.randint(0, vocab, (batch, seq_len))
    with recorder.active():
        logits = logits_of(model(x))
        before_loss = recorder.live
        loss = lm_loss(logits, x)
        loss_level = recorder.live
        del logits
        recorder.open_region("loss")  # log-softmax's backward holds its output, input and output grads
        loss.backward()
    for h in handles:
        h.remove()
    entries = [(path, {**{k: r.values[k] for k in POINTS}, "output": r.output, "fwd_flops": r.flops})
               for path, r in recorder.calls]
    if root:
        entries.insert(0, ("", {**dict.fromkeys(POINTS, 0.0), "output": 0.0, "fwd_flops": recorder.outside.flops}))
    return entries, float(max(before_loss, loss_level, recorder.regions["loss"]))


KEEP_BLOCKS = 2
_LEVELS = POINTS


def _signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def _runs_in_order(list_path: str, n: int, trace: CallTrace, tracked: set[str]) -> bool:
    """The blocks of the list run once each, in order, with no other unit module between them."""
    prefix = f"{list_path}."
    calls = [p for p in trace.sequence if p in tracked]
    inside = [i for i, p in enumerate(calls) if p.startswith(prefix)]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return False
    blocks = [int(calls[i][len(prefix):].split(".")[0]) for i in inside]
    mods = [calls[i] for i in inside]
    return blocks == sorted(blocks) and len(set(mods)) == len(mods) and set(blocks) == set(range(n))


def _truncate_repeats(model: nn.Module, trace: CallTrace, tracked: set[str]) -> tuple[str, int] | None:
    """Cut the longest list of identical blocks to KEEP_BLOCKS; the rest are extrapolated from them.

    Fake-tensor dispatch costs about a millisecond per op, so a 70B model would take minutes to
    trace; identical blocks record identical readings, shifted by the activations each one keeps.
    Only lists whose blocks run once each, one after the other, are cut.
    """
    best: tuple[str, nn.ModuleList] | None = None
    for path, mod in model.named_modules():
        if (isinstance(mod, nn.ModuleList) and len(mod) > KEEP_BLOCKS and len({_signature(b) for b in mod}) == 1
                and (best is None or len(mod) > len(best[1])) and _runs_in_order(path, len(mod), trace, tracked)):
            best = (path, mod)
    if best is None:
        return None
    path, blocks = best
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, nn.ModuleList(list(blocks)[:KEEP_BLOCKS]))
    return path, len(blocks)


def _expand(entries: list[Entry], loss: float, blocks: tuple[str, int]) -> tuple[list[Entry], float]:
    """Readings of the full model from a run on its first KEEP_BLOCKS blocks (see _truncate_repeats)."""
    list_path, n = blocks
    prefix = f"{list_path}."

    def index(path: str) -> int | None:
        return int(path[len(prefix):].split(".")[0]) if path.startswith(prefix) else None

    last = KEEP_BLOCKS - 1
    per_block = sum(v["post_fw"] - v["pre_fw"] for p, v in entries if index(p) == last)

    def shifted(values: dict[str, float], shift: float) -> dict[str, float]:
        return {k: v + shift if k in _LEVELS else v for k, v in values.items()}

    inside = [i for i, (p, _) in enumerate(entries) if index(p) is not None]
    first, end = inside[0], inside[-1] + 1
    out = entries[:first] + [e for e in entries[first:end] if (index(e[0]) or 0) < last]
    repeated = [e for e in entries[first:end] if index(e[0]) == last]
    for i in range(last, n):
        for path, values in repeated:
            rest = path[len(prefix):].partition(".")[2]
            out.append((f"{prefix}{i}.{rest}" if rest else f"{prefix}{i}", shifted(values, (i - last) * per_block)))
    out += [(p, shifted(v, (n - KEEP_BLOCKS) * per_block)) for p, v in entries[end:]]
    return out, loss + (n - KEEP_BLOCKS) * per_block


def profile_model(build: Callable[[str], nn.Module], seq_len: int, vocab_size: int,
                  dtype: torch.dtype = torch.float32) -> ModelProfile:
    """Profile `build("cpu")` (constructed inside fake mode, so any size works) at two batch sizes.

    `dtype` is the compute dtype: under bf16 mixed precision activations are bf16. A module that
    runs twice in the forward has an entry per call, so the cost model sees both.
    """
    runs = []
    default = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)
        try:
            model = build("cpu")
        finally:
            torch.set_default_dtype(default)
        trace = trace_calls(model, seq_len, vocab_size)
        units = units_of(model, trace)
        unit_of = {m: u.name for u in units for m in u.modules}
        param_bytes = {u.name: 4 * u.param_count for u in units}
        linear_params = {u.name: [list(model.get_submodule(path).parameters()) for path in u.linears] for u in units}
        linear_bytes = {u: [4 * sum(p.numel() for p in ps) for ps in lin] for u, lin in linear_params.items()}
        linear_tensors = {u: [len(ps) for ps in lin] for u, lin in linear_params.items()}
        tracked = {m for m in unit_of if m}
        blocks = _truncate_repeats(model, trace, tracked)
        live = {path for path, _ in model.named_modules()}
        for batch in PROFILE_BATCHES:
            entries, loss = _run_once(model, tracked & live, batch, seq_len, vocab_size, ROOT in param_bytes)
            runs.append(_expand(entries, loss, blocks) if blocks else (entries, loss))
    (entries1, loss1), (entries2, loss2) = runs
    b1, b2 = PROFILE_BATCHES
    profiles = [
        ModuleProfile(path, unit_of[path], **{k: Linear1.fit(r1[k], r2[k], b1, b2) for k in r1})
        for (path, r1), (_, r2) in zip(entries1, entries2, strict=True)
    ]
    return ModelProfile(units, profiles, param_bytes, linear_bytes, linear_tensors, Linear1.fit(loss1, loss2, b1, b2))
