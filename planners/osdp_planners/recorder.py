"""A light recorder of live tensor bytes and FLOPs per module over one forward and backward.

torch's MemTracker and FlopCounterMode revisit every tracked module on every op, which grows with
depth squared and takes minutes on a 70B model; this keeps O(1) work per op. It counts each storage
created while it is active once, until it is freed, so parameters (made before) are not counted.

Parameter gradients are held as FSDP2 holds them: a group's unsharded gradients live from their
creation until the group's post-backward (when FSDP2 reduce-scatters and frees them), which fires
when the gradients of the inputs of the group's first module are ready, or at the end of backward
when those inputs need none (an embedding). A checkpointed module re-runs its forward inside its
backward: those forward hooks are not readings of the forward.

A module that runs twice in one forward has a reading per call, keyed by its path for the first and
`path#k` for the k-th (`call_key`); backward runs the calls in reverse, so each backward is matched
to the latest call whose backward has not started.
"""

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from osdp_planners.torch_private import ModTracker, TorchDispatchMode, tree_leaves

MOD_TRACKER_NESTING = "The module hierarchy tracking maybe be messed up"


def call_key(path: str, call: int) -> str:
    """The reading's key for the `call`-th (1-based) forward of the module at `path`."""
    return path if call == 1 else f"{path}#{call}"


@dataclass
class ModuleReadings:
    values: dict[str, float] = field(default_factory=dict)  # pre_fw, post_fw, pre_bw, post_bw
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # fw / bw -> first, last trace index
    flops: float = 0.0


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *_args: Any, out_val: torch.Tensor, **_kw: Any) -> int:
    """torch counts no FLOPs for a grouped matmul (the experts of transformers' mixture-of-experts layers):
    each output element is a dot product over `mat_a`'s last dimension, which two 2D operands (a weight's
    gradient) split among the groups of their 3D output instead."""
    groups = out_val.shape[0] if mat_a.dim() == 2 and mat_b.dim() == 2 else 1
    return 2 * out_val.numel() // groups * mat_a.shape[-1]


def _attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_args: Any, **_kw: Any) -> int:
    """Scores (q k^T) and weighted values of scaled-dot-product attention over every query head, causal or
    not (as torch counts it). Grouped-query attention shares each key/value head among several query heads;
    torch's own formula refuses those shapes before 2.13, so every attention kernel is counted here."""
    batch, heads, s_q, d_qk = query.shape
    s_k, d_v = key.shape[-2], value.shape[-1]
    return 2 * batch * heads * s_q * s_k * (d_qk + d_v)


# torch's counter has the attention kernels of CUDA alone, and the profile traces on CPU fake tensors,
# where scaled_dot_product_attention runs the CPU flash kernel: all of them are counted alike
ATTENTION_KERNELS = (
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
)
FLOP_COUNTS = {
    **flop_registry,
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    **dict.fromkeys(ATTENTION_KERNELS, _attention_flops),
}


class _Live(TorchDispatchMode):
    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
        self.rec = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                rec.track(t)
        packet = func._overloadpacket
        target = rec.forward_target()
        if packet in FLOP_COUNTS and target is not None:
            target.flops += FLOP_COUNTS[packet](*args, **kwargs, out_val=out)
        if func.namespace != "prim":  # prim queries allocate nothing and come and go with fake mode's caches
            rec.mark(packet.__name__)
        return out


class Recorder:
    """Readings for every forward call of the modules named in `paths` (module -> path), in call
    order (`order`), and the FLOPs of the model's forward outside them (`outside`, the root's work);
    `grad_groups` maps the module whose
    post-backward frees a gradient group (FSDP2's) to that group's parameters.

    `trace` holds the live bytes after every op: a peak is kept as the stretch of the trace it is the
    maximum of, so that runs at two batch sizes (the same ops in the same order) give each op's bytes
    as a line in the batch, and a peak as the maximum of those lines (see profile.Peak).
    """

    def __init__(
        self, paths: dict[nn.Module, str], model: nn.Module, grad_groups: dict[nn.Module, list[nn.Parameter]]
    ) -> None:
        self.paths = paths
        self.grad_groups = grad_groups
        self.model = model
        self.readings: dict[str, ModuleReadings] = {}
        self.order: list[str] = []  # call keys in the order their forwards started
        self.outside = ModuleReadings()
        self.live = 0.0
        self.trace: list[float] = []
        self.reduced = 0.0  # bytes of split slices' gradients reduce-scattered so far (see `reduce`)
        self.reduced_trace: list[float] = []  # `reduced` after every op, beside `trace`
        self.ops: list[str] = []  # what ran at each trace index (runs are aligned by it)
        self._calls: dict[str, int] = {}
        self._forward: list[str] = []  # call keys whose forward is running, innermost last
        self._in_model = False
        self._awaiting_bw: dict[str, list[str]] = {}  # path -> call keys whose backward has not started
        self._in_bw: dict[str, list[str]] = {}
        self._seen: dict[int, int] = {}
        self._open: dict[tuple[str, str], int] = {}
        self.regions: dict[str, tuple[int, int]] = {}  # name -> a stretch outside any module (see open_region)
        # views of parameters (a Linear's weight.t()) share their storage: never count it
        self._params = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

    def forward_target(self) -> ModuleReadings | None:
        if self._forward:
            return self.readings[self._forward[-1]]
        return self.outside if self._in_model else None

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen or key in self._params:
            return
        size = storage.nbytes()
        self._seen[key] = size
        self.live += size
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def forget(self, t: torch.Tensor) -> None:
        """Count `t` as freed now (its storage may outlive it in fake mode's caches)."""
        self._free(id(t.untyped_storage()))

    def reduce(self, t: torch.Tensor) -> None:
        """Count a split slice's gradient `t` as reduce-scattered now: freed here, its bytes added to
        `reduced`, since FSDP2 keeps a shard of it whose size depends on the option, not the profile."""
        self.reduced += self._seen.get(id(t.untyped_storage()), 0)
        self.forget(t)

    def mark(self, op: str = "") -> int:
        """Record the live bytes now (after `op`); returns its trace index."""
        self.trace.append(self.live)
        self.reduced_trace.append(self.reduced)
        self.ops.append(op)
        return len(self.trace) - 1

    def _start(self, path: str, phase: str) -> None:
        self.readings[path].values[f"pre_{phase}"] = self.live
        self._open[(path, phase)] = self.mark()

    def _end(self, path: str, phase: str) -> None:
        r = self.readings[path]
        r.spans[phase] = (self._open.pop((path, phase)), self.mark())
        r.values[f"post_{phase}"] = self.live

    def open_region(self, name: str) -> None:
        """Track the stretch from now until the next module's backward starts (the loss's own backward)."""
        self._open[(name, "region")] = self.mark()

    def _close_regions(self) -> None:
        for name, phase in list(self._open):
            if phase == "region":
                self.regions[name] = (self._open.pop((name, phase)), self.mark())

    def _free_grads(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.grad is not None:
                self.forget(p.grad)
                p.grad = None

    def close_all(self) -> None:
        """Backward hooks of modules whose inputs need no grad (embeddings) never fire: close at the end."""
        self._close_regions()
        for path, phase in list(self._open):
            self._end(path, phase)
        end = self.mark()
        for r in self.readings.values():  # a call whose output took no part in the loss
            for phase in ("fw", "bw"):
                r.spans.setdefault(phase, (end, end))
                r.values.setdefault(f"pre_{phase}", self.live)
                r.values.setdefault(f"post_{phase}", self.live)
        for params in self.grad_groups.values():
            self._free_grads(params)

    @contextmanager
    def active(self) -> Iterator[None]:
        tracker = ModTracker()

        def pre_fw(mod: nn.Module, _inp: Any) -> None:
            if tracker.is_bw:
                return
            if mod is self.model:
                self._in_model = True
            if mod in self.paths:
                path = self.paths[mod]
                self._calls[path] = self._calls.get(path, 0) + 1
                key = call_key(path, self._calls[path])
                self.readings[key] = ModuleReadings()
                self.order.append(key)
                self._forward.append(key)
                self._start(key, "fw")

        def post_fw(mod: nn.Module, _inp: Any, _out: Any) -> None:
            if tracker.is_bw:
                return
            if mod is self.model:
                self._in_model = False
            if mod in self.paths:
                key = self._forward.pop()
                self._end(key, "fw")
                self._awaiting_bw.setdefault(self.paths[mod], []).append(key)

        def pre_bw(mod: nn.Module | None, _g: Any) -> None:
            self._close_regions()
            if mod in self.paths and self._awaiting_bw.get(self.paths[mod]):
                key = self._awaiting_bw[self.paths[mod]].pop()
                self._start(key, "bw")
                self._in_bw.setdefault(self.paths[mod], []).append(key)

        def post_bw(mod: nn.Module | None, _g: Any) -> None:
            if mod in self.paths and self._in_bw.get(self.paths[mod]):
                self._end(self._in_bw[self.paths[mod]].pop(), "bw")  # read before the group's gradients go
            if mod in self.grad_groups:
                self._free_grads(self.grad_groups.pop(mod))

        tracker.register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)
        with tracker, _Live(self), warnings.catch_warnings():
            # ModTracker names a module outside the model's tree by its class, so two of transformers'
            # kernelized functions (`Func`, rotary embeddings) nest under one name and it warns; readings
            # are keyed by this recorder's own paths, which those modules are not among
            warnings.filterwarnings("ignore", message=MOD_TRACKER_NESTING)
            yield
        self.close_all()
