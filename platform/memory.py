"""Measured peak memory of one training step on this rank.

CUDA: the caching allocator's peak. CPU has no allocator statistics, so torch's MemTracker counts
live tensor storages instead (the same totals as FSDP2's own tracker, which rejects units of tied
modules); it slows every op, so the caller measures only chosen steps.
"""

from collections.abc import Callable

import torch
from torch import nn

from osdp_planners.torch_private import MemTracker


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
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(sum(snap["Total"] for snap in peaks.values()))
