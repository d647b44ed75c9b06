"""Measured compute time: real tensors, forward and backward at two batches, and the optimizer step.

Used when the model fits where it is measured (always for CPU pools, whose presets carry no reliable
FLOP rate); otherwise the cost model falls back to FLOPs over the preset's sustained rate. A GPU is
timed in this process; a CPU pool on concurrent processes, as its workers run (see model_probe).
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.profile import Linear1

TIMING_BATCHES = (1, 4)
REPEATS = 9


@dataclass(frozen=True)
class MeasuredTimes:
    forward: dict[str, Linear1]  # unit -> seconds for its forward at a micro batch
    backward: dict[str, Linear1]
    optimizer_s_per_param: float  # AdamW step time per parameter owned


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The training loss on `x` (its own tokens as targets: timing does not care what is predicted)."""
    return lm_loss(logits_of(model(x)), x)


def _time_pass(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward (with the loss) and of its backward (synchronised on CUDA)."""
    _sync(device)
    t0 = time.perf_counter()
    loss = forward_loss(model, x)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def measure_totals(
    model: nn.Module,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    barrier: Callable[[], object] = lambda: None,
    slowest: Callable[[list[float]], list[float]] = lambda t: t,
) -> dict[str, Any]:
    """Whole-model medians: forward and backward seconds per timing batch, AdamW seconds per parameter.

    The batches take turns, so a slow spell of a shared machine does not bend the fitted slope.
    `barrier` lines concurrent processes up before each pass, as a training step's collectives do,
    and `slowest` turns each rank's time into the slowest rank's (the step's).
    """
    inputs = {b: torch.randint(0, vocab_size, (b, seq_len), device=device) for b in TIMING_BATCHES}
    runs: dict[int, list[list[float]]] = {b: [] for b in TIMING_BATCHES}
    for i in range(REPEATS + 1):
        for batch, x in inputs.items():
            barrier()
            timed = slowest(list(_time_pass(model, x, device)))
            if i:  # the first round warms up allocator and kernels
                runs[batch].append(timed)
    totals: dict[str, Any] = {
        "forward": {str(b): statistics.median(r[0] for r in rs) for b, rs in runs.items()},
        "backward": {str(b): statistics.median(r[1] for r in rs) for b, rs in runs.items()},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    steps = []
    for _ in range(REPEATS):
        barrier()
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        steps += slowest([time.perf_counter() - t0])
    totals["optimizer_s_per_param"] = statistics.median(steps) / sum(p.numel() for p in model.parameters())
    return totals


def share_by_flops(totals: dict[str, Any], flops: dict[str, float]) -> MeasuredTimes:
    """Whole-pass times shared out by FLOPs (`flops`: unit -> forward FLOPs).

    Timings of single small units are noise on a busy CPU; the whole pass is stable, and a unit's
    share of it follows its share of the FLOPs. Fits are clamped to be non-negative.
    """
    b1, b2 = TIMING_BATCHES
    whole = sum(flops.values()) or 1.0

    def fit(kind: str) -> Linear1:
        line = Linear1.fit(totals[kind][str(b1)], totals[kind][str(b2)], b1, b2)
        return Linear1(max(line.a, 0.0), max(line.b, 0.0))

    fwd, bwd = fit("forward"), fit("backward")
    return MeasuredTimes(
        {u: Linear1(fwd.a * f / whole, fwd.b * f / whole) for u, f in flops.items()},
        {u: Linear1(bwd.a * f / whole, bwd.b * f / whole) for u, f in flops.items()},
        totals["optimizer_s_per_param"],
    )


def measure_times(
    build: Callable[[str], nn.Module], seq_len: int, vocab_size: int, device: torch.device, flops: dict[str, float]
) -> MeasuredTimes:
    """Time the model in this process on `device`."""
    return share_by_flops(measure_totals(build(str(device)), seq_len, vocab_size, device), flops)
