"""One forward of any model on fake tensors: which modules run, how often, what reads each parameter.

Unit discovery needs what a module tree does not say: whether a module runs (a `Sequential` may be
iterated as a list, a child may never be called), how often (a block run twice), and which modules
are active when each parameter is read (`x @ self.embed.weight.T` outside the embedding). The
planner and `apply_plan` both trace, so both find the same units. The user's forward runs here
first, so a model the platform cannot plan fails here with one message naming its module.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from osdp_planners.errors import UserError
from osdp_planners.loss import logits_of
from osdp_planners.torch_private import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    TorchDispatchMode,
    detect_fake_mode,
    tree_leaves,
)

ROOT = "<root>"
TRACE_BATCH = 2
MODEL_CONTRACT = (
    "forward(tokens) must take int64 tokens [batch, seq] and return logits [batch, seq, vocab] (or an "
    "object with .logits), run on fake tensors (no .item(), no branches on tensor values) and create "
    "tensors on the input's device; see the README's 'Your own model'"
)


@dataclass
class CallTrace:
    """One forward of the model on fake tensors, as discovery needs it."""

    calls: dict[str, int] = field(default_factory=dict)  # module path -> times it ran
    sequence: list[str] = field(default_factory=list)  # module paths in the order their forwards started
    first: dict[str, int] = field(default_factory=dict)  # module path -> position of its first call
    uses: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)  # parameter -> active module paths
    opaque: set[str] = field(default_factory=set)  # modules whose output shows pytree no tensor

    def runs(self, path: str) -> bool:
        return self.calls.get(path, 0) > 0


class _ParamUses(TorchDispatchMode):
    """Records the modules active whenever an op reads a parameter."""

    def __init__(self, names: dict[int, str], stack: list[str], trace: CallTrace) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.names, self.stack, self.trace = names, stack, trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            name = self.names.get(id(t))
            if name is not None:
                self.trace.uses.setdefault(name, set()).add(tuple(self.stack))
        return func(*args, **(kwargs or {}))


@contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Undo what a traced forward does to the modules' attributes (a mask or cache built on first call)."""
    registries = ("_parameters", "_buffers", "_modules")
    saved = [(m, dict(m.__dict__), {k: dict(getattr(m, k)) for k in registries}) for m in model.modules()]
    try:
        yield
    finally:
        for module, attrs, regs in saved:
            for key in set(module.__dict__) - set(attrs):
                del module.__dict__[key]
            module.__dict__.update(attrs)
            for key, content in regs.items():
                live = getattr(module, key)
                live.clear()
                live.update(content)


def _trace_device(model: nn.Module) -> torch.device:
    first = next(iter([*model.parameters(), *model.buffers()]), None)
    return torch.device("cpu") if first is None or first.device.type == "meta" else first.device


@contextmanager
def fake_state(
    model: nn.Module, param_dtype: torch.dtype | None = None
) -> Iterator[tuple[dict[str, torch.Tensor], torch.device]]:
    """Fake tensors of `model`'s parameters and buffers (by name) and their device (CPU for a meta model),
    inside a fake mode, for `functional_call`; what a forward does to the modules is undone after.
    Meta tensors alone do not do: a model may read a value that fake tensors let it skip (transformers'
    masks check for packed sequences unless the input is fake). `param_dtype` recasts the floating
    parameters, and only them, as FSDP2's mixed-precision policy does."""
    device = _trace_device(model)
    mode = detect_fake_mode() or FakeTensorMode(allow_non_fake_inputs=True)

    def dtype(t: torch.Tensor, is_param: bool) -> torch.dtype:
        return param_dtype if is_param and param_dtype is not None and t.is_floating_point() else t.dtype

    tensors = [(n, t, True) for n, t in model.named_parameters()] + [(n, t, False) for n, t in model.named_buffers()]
    with _restored(model), torch.random.fork_rng(devices=[]), mode:
        yield (
            {
                n: torch.empty(t.shape, dtype=dtype(t, p), device=device, requires_grad=t.requires_grad)
                for n, t, p in tensors
            },
            device,
        )


def _fail(model: nn.Module, path: str, problem: str) -> UserError:
    kind = type(model.get_submodule(path)).__name__
    return UserError("model", path or ROOT, f"{kind}: {problem}", MODEL_CONTRACT)


def trace_calls(
    model: nn.Module, seq_len: int, vocab_size: int | None = None, param_dtype: torch.dtype | None = None
) -> CallTrace:
    """Run `model` once on fake tensors of its parameters' shapes; the model itself is left untouched.

    Grad mode stays as training has it: some modules take another path without grad (fused kernels).
    `vocab_size`, when given, is the token range of the data: the logits must cover it. `param_dtype`
    fakes the floating parameters in that dtype (see `fake_state`).
    """
    paths = {id(m): p for p, m in model.named_modules()}
    trace, stack = CallTrace(), []

    def pre(module: nn.Module, _args: Any) -> None:
        path = paths[id(module)]
        stack.append(path)
        trace.calls[path] = trace.calls.get(path, 0) + 1
        trace.first.setdefault(path, len(trace.sequence))
        trace.sequence.append(path)

    def post(_module: nn.Module, _args: Any, out: Any) -> None:
        path = stack.pop()
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            trace.opaque.add(path)

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with fake_state(model, param_dtype) as (fakes, device):
            names = {id(fakes[n]): n for n, _ in model.named_parameters()}
            tokens = torch.zeros(TRACE_BATCH, seq_len, dtype=torch.long, device=device)
            try:
                with _ParamUses(names, stack, trace), _meta_errors_quiet():
                    out = functional_call(model, fakes, (tokens,))
            except Exception as exc:  # the user's forward: name the module it failed in
                where = stack[-1] if stack else ""
                text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                if isinstance(exc, DataDependentOutputException | DynamicOutputShapeException):
                    text += ": it reads a tensor's value, which the planner's fake tensors do not have"
                raise _fail(
                    model,
                    where,
                    f"forward raised {type(exc).__name__}: {text} (planner tracing "
                    f"forward(tokens [{TRACE_BATCH}, {seq_len}]) on fake tensors)",
                ) from exc
            try:
                logits = logits_of(out)
            except TypeError as exc:
                raise _fail(model, "", str(exc)) from None
            shape = tuple(logits.shape)
            if len(shape) != 3 or shape[:2] != (TRACE_BATCH, seq_len):
                raise _fail(
                    model,
                    "",
                    f"forward(tokens [{TRACE_BATCH}, {seq_len}]) returned logits of shape {shape}, "
                    f"expected [{TRACE_BATCH}, {seq_len}, vocab]",
                )
            if vocab_size is not None and shape[2] < vocab_size:
                raise _fail(
                    model,
                    "",
                    f"the logits cover {shape[2]} tokens, the data has {vocab_size} (token ids 0..{vocab_size - 1})",
                )
    finally:
        for h in handles:
            h.remove()
    return trace


def _in_bf16(model: nn.Module, seq_len: int, vocab_size: int | None) -> CallTrace | None:
    """The trace with bf16 parameters where `model` has floating ones of another dtype and it succeeds.

    torch's meta kernel of `_grouped_mm` (the experts of transformers' mixture-of-experts layers)
    accepts bf16 alone, as the CUDA kernel it mirrors, so such a forward traces only as FSDP2's
    bf16-mixed policy runs it.
    """
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not floats or floats == {torch.bfloat16}:
        return None
    try:
        return trace_calls(model, seq_len, vocab_size, torch.bfloat16)
    except UserError:
        return None


def bf16_only(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> bool:
    """Whether `model`, which failed to trace in its own dtype, traces with bf16 parameters."""
    return _in_bf16(model, seq_len, vocab_size) is not None


def fp32_refused(exc: UserError) -> UserError:
    """The refusal of fp32 training for a model whose fp32 trace failed with `exc` and that traces in bf16."""
    return UserError(
        "train.precision",
        "fp32",
        f"the model traces only with bf16 parameters; in fp32 {exc.field} {exc.value!r}: {exc.problem}",
        "use train.precision=bf16-mixed (bf16 compute over fp32 master weights)",
    )


def check_forward(model: nn.Module, seq_len: int, precision: str) -> None:
    """The user's forward traced as training under `precision` will run it, so that a model the planner
    cannot trace is refused before Ray starts (it would fail in the planner actor, 10-60 s later)."""
    try:
        trace_calls(model, seq_len)
    except UserError as exc:
        if not bf16_only(model, seq_len):
            raise
        if precision == "fp32":
            raise fp32_refused(exc) from exc


def trace_structure(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> CallTrace:
    """The trace that unit discovery needs: which modules run and what reads each parameter does not
    depend on the dtype, so a forward that traces only with bf16 parameters is traced with them."""
    try:
        return trace_calls(model, seq_len, vocab_size)
    except UserError:
        in_bf16 = _in_bf16(model, seq_len, vocab_size)
        if in_bf16 is None:
            raise
        return in_bf16


@contextmanager
def _meta_errors_quiet() -> Iterator[None]:
    """Fake tensors log each failing meta kernel's traceback as an error; the trace's own error names it."""
    logger = logging.getLogger(FakeTensorMode.__module__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
