"""A light recorder of live tensor bytes and FLOPs per module over one forward and backward.

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


@dataclass
class ModuleReadings:
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
        if packet in flop_registry and rec.current_fw is not None:
            rec.readings[rec.current_fw].flops += flop_registry[packet](*args, **kwargs, out_val=out)
        rec.touch()
        return out


class Recorder:
    """Readings for the modules named in `paths` (module -> path)."""

    def __init__(self, paths: dict[nn.Module, str], model: nn.Module) -> None:
        self.paths = paths
        self.readings = {p: ModuleReadings() for p in paths.values()}
        self.live = 0.0
        self.current_fw: str | None = None
        self._seen: dict[int, int] = {}
        self._open_peaks: dict[tuple[str, str], float] = {}
        self.regions: dict[str, float] = {}  # name -> peak of a stretch outside any module (see open_region)
        # views of parameters (a Linear's weight.t()) share their storage: never count it
        self._params = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}

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

    def _open(self, path: str, phase: str) -> None:
        self.readings[path].values[f"pre_{phase}"] = self.live
        self._open_peaks[(path, phase)] = self.live

    def _close(self, path: str, phase: str) -> None:
        r = self.readings[path].values
        r[f"peak_{phase}"] = max(self._open_peaks.pop((path, phase), self.live), self.live)
        r[f"post_{phase}"] = self.live

    def open_region(self, name: str) -> None:
        """Track the peak from now until the next module's backward starts (the loss's own backward)."""
        self._open_peaks[(name, "region")] = self.live

    def _close_regions(self) -> None:
        for name, phase in list(self._open_peaks):
            if phase == "region":
                self.regions[name] = self._open_peaks.pop((name, phase))

    def close_all(self) -> None:
        """Backward hooks of modules whose inputs need no grad (embeddings) never fire: close at the end."""
        self._close_regions()
        for path, phase in list(self._open_peaks):
            self._close(path, phase)

    @contextmanager
    def active(self) -> Iterator[None]:
        tracker = ModTracker()

        def pre_fw(mod: nn.Module, _inp: Any) -> None:
            if mod in self.paths:
                self.current_fw = self.paths[mod]
                self._open(self.paths[mod], "fw")

        def post_fw(mod: nn.Module, _inp: Any, out: Any) -> None:
            if mod in self.paths:
                self._close(self.paths[mod], "fw")
                self.readings[self.paths[mod]].output = float(sum(
                    t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
                self.current_fw = None

        def pre_bw(mod: nn.Module | None, _g: Any) -> None:
            self._close_regions()
            if mod in self.paths:
                self._open(self.paths[mod], "bw")

        def post_bw(mod: nn.Module | None, _g: Any) -> None:
            if mod in self.paths and (self.paths[mod], "bw") in self._open_peaks:
                self._close(self.paths[mod], "bw")

        tracker.register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)
        with tracker, _Live(self):
            yield
        self.close_all()
