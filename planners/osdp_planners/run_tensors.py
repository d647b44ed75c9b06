"""Where a profile's variant runs keep their tensors: fake ones (any size) or, for a small model, real CPU ones.

Fake-tensor dispatch costs about 0.1 ms an op, more than a small model's real kernels; profiler.py
decides per model whether its runs record the same on real tensors.
"""

from contextlib import AbstractContextManager

import torch
from torch import nn

from osdp_planners.profile import PROFILE_BATCHES
from osdp_planners.torch_private import FakeTensorMode

REAL_RUN_FLOPS = 2e9  # a profile run of at most this many FLOPs (its linear layers') runs on real CPU tensors


def small_enough(full: nn.Module, seq_len: int) -> bool:
    """Whether a variant run (forward and backward at the larger profile batch) is small enough for real
    CPU tensors: a fraction of a second of kernels, and memory a planner never misses."""
    params = sum(p.numel() for p in full.parameters())
    return 6 * params * max(PROFILE_BATCHES) * seq_len <= REAL_RUN_FLOPS


def tensors(real: bool) -> AbstractContextManager[object]:
    """Where a variant's model is built and run: real tensors (drawing from a forked RNG, so that profiling
    leaves the caller's seed alone) or a fake mode of its own."""
    return torch.random.fork_rng(devices=[]) if real else FakeTensorMode()
