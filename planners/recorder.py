"""A light recorder of live tensor bytes and FLOPs per module call over one forward and backward.

torch's MemTracker and FlopCounterMode revisit every tracked module on every op, which grows with
depth squared and takes minutes on a 70B model; this keeps O(1) work per op. It counts each storage
created while it is active once, until it is freed, so parameters (made before) are not counted.
"""

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

POINTS = ("pre_fw", "peak_fw", "post_fw", "pre_bw", "peak_bw", "post_bw")


@dataclass(eq=False)
class ModuleReadings:
    """One forward call of a module (and that call's backward)."""

    values: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0
    output: float = 0.0


class _Live(TorchDispatchMode):
    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
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
        if packet in flop_registry and target is not None:
            target.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        rec.touch()
        return out


class Recorder:
    """Readings for every forward call of the modules named in `paths` (module -> path), in call order.

    A module that runs twice has two readings; each backward is matched to the latest call whose
    backward has not started (backward runs the calls in reverse). FLOPs of the model's own forward
    outside every tracked module (the root's work) go to `outside`.
    """

    def __init__(self, paths: dict[nn.Module, str], model: nn.Module) -> None:
        self.paths = paths
        self.model = model
        self.calls: list[tuple[str, ModuleReadings]] = []
        self.outside = ModuleReadings()
        self.live = 0.0
        self._in_model = False
        self._forward: list[ModuleReadings] = []  # calls whose forward is running, innermost last
        self._awaiting_bw: dict[str, list[ModuleReadings]] = {}
        self._in_bw: dict[str, list[ModuleReadings]] = {}
        self._seen: dict[int, int] = {}
        self._open_peaks: dict[tuple[ModuleReadings, str], float] = {}
        self._region_peaks: dict[str, float] = {}
        self.regions: dict[str, float] = {}  # name -> peak of a stretch outside any module (see open_region)
        # views of parameters (a Linear's weight.t()) share their storage: never count it
        self._params = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

    def forward_target(self) -> ModuleReadings | None:
        if self._forward:
            return self._forward[-1]
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

    def touch(self) -> None:
        for k, v in self._open_peaks.items():
            if self.live > v:
                self._open_peaks[k] = self.live
        for k, v in self._region_peaks.items():
            if self.live > v:
                self._region_peaks[k] = self.live

    def _open(self, r: ModuleReadings, phase: str) -> None:
        r.values[f"pre_{phase}"] = self.live
        self._open_peaks[(r, phase)] = self.live

    def _close(self, r: ModuleReadings, phase: str) -> None:
        r.values[f"peak_{phase}"] = max(self._open_peaks.pop((r, phase), self.live), self.live)
        r.values[f"post_{phase}"] = self.live

    def open_region(self, name: str) -> None:
        """Track the peak from now until the next module's backward starts (the loss's own backward)."""
        self._region_peaks[name] = self.live

    def _close_regions(self) -> None:
        self.regions.update(self._region_peaks)
        self._region_peaks.clear()

    def close_all(self) -> None:
        """Backward hooks of modules whose inputs need no grad (embeddings) never fire: close at the end."""
        self._close_regions()
        for r, phase in list(self._open_peaks):
            self._close(r, phase)
        for _, r in self.calls:
            for point in POINTS:
                r.values.setdefault(point, 0.0)  # a call whose output took no part in the loss

    @contextmanager
    def active(self) -> Iterator[None]:
        tracker = ModTracker()

        def pre_fw(mod: nn.Module, _inp: Any) -> None:
            if mod is self.model:
                self._in_model = True
            if mod in self.paths:
                r = ModuleReadings()
                self.calls.append((self.paths[mod], r))
                self._forward.append(r)
                self._open(r, "fw")

        def post_fw(mod: nn.Module, _inp: Any, out: Any) -> None:
            if mod is self.model:
                self._in_model = False
            if mod in self.paths:
                r = self._forward.pop()
                self._close(r, "fw")
                r.output = float(sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                                     if isinstance(t, torch.Tensor)))
                self._awaiting_bw.setdefault(self.paths[mod], []).append(r)

        def pre_bw(mod: nn.Module | None, _g: Any) -> None:
            self._close_regions()
            if mod in self.paths and self._awaiting_bw.get(self.paths[mod]):
                r = self._awaiting_bw[self.paths[mod]].pop()
                self._open(r, "bw")
                self._in_bw.setdefault(self.paths[mod], []).append(r)

        def post_bw(mod: nn.Module | None, _g: Any) -> None:
            if mod in self.paths and self._in_bw.get(self.paths[mod]):
                self._close(self._in_bw[self.paths[mod]].pop(), "bw")

        tracker.register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)
        with tracker, _Live(self):
            yield
        self.close_all()
