"""Measured compute time on the sample worker: real tensors, forward and backward, two batches.

Used when the model fits on the worker (always for CPU pools, whose presets carry no reliable FLOP
rate); otherwise the cost model falls back to FLOPs over the preset's sustained rate.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from osdp_planners.profile import Linear1

TIMING_BATCHES = (1, 4)
REPEATS = 5


@dataclass(frozen=True)
class MeasuredTimes:
    forward: dict[str, Linear1]  # unit -> seconds for its forward at a micro batch
    backward: dict[str, Linear1]
    optimizer_s_per_param: float  # AdamW step time per parameter owned


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_pass(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward (with the loss) and of its backward (synchronised on CUDA)."""
    _sync(device)
    t0 = time.perf_counter()
    logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def measure_times(build: Callable[[str], nn.Module], seq_len: int, vocab_size: int, device: torch.device,
                  flops: dict[str, float]) -> MeasuredTimes:
    """Whole-model forward and backward times (median of REPEATS) at two batches, shared out by FLOPs.

    Timings of single small units are noise on a busy CPU; the whole pass is stable, and a unit's
    share of it follows its share of the FLOPs (`flops`: unit -> forward FLOPs). Fits are clamped
    to be non-negative.
    """
    model = build(str(device))
    totals = {}
    for batch in TIMING_BATCHES:
        x = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        runs = [_time_pass(model, x, device) for _ in range(REPEATS + 1)][1:]
        totals[batch] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    b1, b2 = TIMING_BATCHES
    whole = sum(flops.values()) or 1.0
    share = {u: f / whole for u, f in flops.items()}

    def fit(i: int) -> Linear1:
        line = Linear1.fit(totals[b1][i], totals[b2][i], b1, b2)
        return Linear1(max(line.a, 0.0), max(line.b, 0.0))

    fwd, bwd = fit(0), fit(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        opt.step()
    _sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    return MeasuredTimes(
        {u: Linear1(fwd.a * s, fwd.b * s) for u, s in share.items()},
        {u: Linear1(bwd.a * s, bwd.b * s) for u, s in share.items()},
        (time.perf_counter() - t0) / REPEATS / n_params,
    )
