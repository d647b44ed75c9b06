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


def _time_units(model: nn.Module, modules: dict[str, str], x: torch.Tensor, device: torch.device
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per unit in forward and backward, from hook timestamps (synchronised on CUDA)."""
    fwd: dict[str, float] = dict.fromkeys(modules.values(), 0.0)
    bwd: dict[str, float] = dict.fromkeys(modules.values(), 0.0)
    start: dict[str, float] = {}
    handles = []
    for path, unit in modules.items():
        mod = model.get_submodule(path)

        def pre(_m: nn.Module, _a: object, path: str = path) -> None:
            _sync(device)
            start[path] = time.perf_counter()

        def post(_m: nn.Module, _a: object, _o: object, path: str = path, unit: str = unit) -> None:
            _sync(device)
            fwd[unit] += time.perf_counter() - start[path]

        def bpre(_m: nn.Module, _g: object, path: str = path) -> None:
            _sync(device)
            start["bw" + path] = time.perf_counter()

        def bpost(_m: nn.Module, _gi: object, _go: object, path: str = path, unit: str = unit) -> None:
            _sync(device)
            bwd[unit] += time.perf_counter() - start["bw" + path]

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post),
                    mod.register_full_backward_pre_hook(bpre), mod.register_full_backward_hook(bpost)]
    logits = model(x)
    F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
    for h in handles:
        h.remove()
    return fwd, bwd


def measure_times(build: Callable[[str], nn.Module], modules: dict[str, str], seq_len: int, vocab_size: int,
                  device: torch.device, flops: dict[str, float]) -> MeasuredTimes:
    """Whole-model forward and backward times (median of REPEATS) at two batches, shared out by FLOPs.

    Hook timings of single small units are noise on a busy CPU; the whole pass is stable, and a
    unit's share of it follows its share of the FLOPs. Fits are clamped to be non-negative.
    """
    model = build(str(device))
    totals = {}
    for batch in TIMING_BATCHES:
        x = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        runs = [_time_units(model, modules, x, device) for _ in range(REPEATS + 1)][1:]
        totals[batch] = (statistics.median(sum(r[0].values()) for r in runs),
                         statistics.median(sum(r[1].values()) for r in runs))
    b1, b2 = TIMING_BATCHES
    whole = sum(flops.values()) or 1.0
    share = {u: flops.get(u, 0.0) / whole for u in set(modules.values())}

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
