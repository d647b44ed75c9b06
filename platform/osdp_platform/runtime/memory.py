"""Measured peak memory of one training step on this rank.

CUDA: the caching allocator's allocated peak, and its reserved peak beside it. CPU has no allocator
statistics, so torch's MemTracker counts live tensor storages instead (the same totals as FSDP2's own
tracker, which rejects units of tied modules); it slows every op, so the caller measures only chosen steps.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from osdp_planners.torch_private import MemTracker


@contextmanager
def tracking(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[MemTracker]:
    """A MemTracker over a whole step of any number of micro batches.

    MemTracker refuses a second forward of the root module in one session (it takes it for the next
    iteration), and gradient accumulation runs the root once per micro batch. Its per-module records
    are cleared before each root forward, which keeps the running peak the step is measured by; the
    hook is registered first, so it runs before the tracker's own.
    """
    tracker = MemTracker()
    tracker.track_external(model, optimizer)

    def next_micro_batch(module: nn.Module, _inputs: Any) -> None:
        if module is model:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(next_micro_batch)
    try:
        with tracker:
            yield tracker
    finally:
        handle.remove()


def peak_snapshot(tracker: MemTracker) -> dict[str, int]:
    """The tracker's peak bytes by category, with their sum under "Total" (devices added up)."""
    out: dict[str, int] = {}
    for snap in tracker.get_tracker_snapshot("peak").values():
        for category, nbytes in snap.items():
            out[category] = out.get(category, 0) + int(nbytes)
    return out


def measure_step_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None], device: torch.device
) -> int:
    """Run `step` once and return the peak bytes it held on `device` (model states included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    with tracking(model, optimizer) as tracker:
        step()
    return peak_snapshot(tracker)["Total"]


def reserved_peak(device: torch.device) -> int | None:
    """The caching allocator's reserved peak since `measure_step_peak` reset it (CUDA; None elsewhere):
    what an OOM is decided by, beside the allocated peak the planner simulates."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
