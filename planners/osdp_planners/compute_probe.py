"""Measured compute time: real tensors, forward and backward at two batches, and the optimizer step.

Timed as the workers train (osdp_planners.runtime): under bf16-mixed the passes run on a bf16 copy of
the model (what FSDP2's param_dtype computes with) and the optimizer steps the fp32 master weights;
fp32 and bf16 kernels differ several-fold in speed, on GPUs and CPUs alike.

Used when the model fits where it is measured (always for CPU pools, whose presets carry no reliable
FLOP rate); otherwise the cost model falls back to FLOPs over the preset's sustained rate. A GPU is
timed in this process; a CPU pool on concurrent processes, as its workers run (see model_probe).
"""

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.profile import Linear1
from osdp_planners.runtime import compile_units, compute_dtype, make_optimizer
from osdp_planners.torch_private import checkpoint, set_recomputing
from osdp_planners.units import ROOT, find_units

TIMING_BATCHES = (1, 4)
# a micro batch beyond this multiple of the largest timing batch is priced by the line far past what was
# timed: on the 2-core CPU, 2 workers at micro batch 32-128 stepped 1.2-2.2x the prediction, against
# 1.0-1.7x at 4-8 (benchmarks/RESULTS.md, "Measured by other scripts"). A plan there is timed again at
# its own micro batch (make_plan); where a GPU's probe runs out of memory at it, the plan says that its
# times are extrapolated
EXTRAPOLATION_SAID = 4
REPEATS = 9
PROBE_FRACTION = 0.5  # of a GPU's memory the states of a probe's model may take
PROBE_BYTES_PER_PARAM = 20  # fp32 weights, gradients and two moments, and the bf16 copy with its gradients


@dataclass(frozen=True)
class MeasuredTimes:
    forward: dict[str, Linear1]  # unit -> seconds for its forward at a micro batch
    backward: dict[str, Linear1]
    optimizer_s_per_param: float  # optimizer step time per parameter owned
    # GPU: strategy -> seconds FSDP2 adds per parameter byte of a unit, a line in the micro batch (fsdp_probe)
    fsdp_s_per_byte: dict[str, Linear1] = field(default_factory=dict)
    # GPU: strategy -> seconds each further FSDP2 unit of a split adds (its slices), a line in the micro batch
    fsdp_s_per_unit: dict[str, Linear1] = field(default_factory=dict)
    # GPU: strategy -> seconds each DTensor adds to the optimizer step (fsdp_probe; on CPU pools, comm_probe)
    optimizer_tensor_cost_s: dict[str, float] = field(default_factory=dict)
    cpu_wait_share: float | None = None  # of the probe's time its (busiest) thread waited for a CPU (cpu_wait)
    # unit -> seconds activation checkpointing adds to it (the recomputed forward and the hooks around it)
    recompute: dict[str, Linear1] = field(default_factory=dict)
    batches: tuple[int, int] = TIMING_BATCHES  # the micro batches timed: the lines pass through them

    def fsdp_at(self, strategy: str, batch: int) -> tuple[float, float]:
        """FSDP2's seconds per parameter byte and per further unit at a micro batch: measured at both
        timing batches, a line between them and the nearer measurement outside them. Its host work
        (hooks, launches) hides behind more compute at a larger batch, so it is not a constant; beyond
        the measured batches a line would guess. Nothing where not measured."""
        lo, hi = self.batches
        at = min(max(batch, lo), hi)
        lines = (self.fsdp_s_per_byte.get(strategy), self.fsdp_s_per_unit.get(strategy))
        per_byte, per_unit = (max(line.at(at), 0.0) if line else 0.0 for line in lines)
        return per_byte, per_unit

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeasuredTimes":
        """The inverse of `to_dict` (a cached measurement read back)."""
        return cls(
            {u: Linear1(**line) for u, line in d["forward"].items()},
            {u: Linear1(**line) for u, line in d["backward"].items()},
            d["optimizer_s_per_param"],
            {s: Linear1(**line) for s, line in d["fsdp_s_per_byte"].items()},
            {s: Linear1(**line) for s, line in d["fsdp_s_per_unit"].items()},
            d["optimizer_tensor_cost_s"],
            d.get("cpu_wait_share"),
            {u: Linear1(**line) for u, line in d["recompute"].items()},
            (d["batches"][0], d["batches"][1]),
        )

    def extrapolated_to(self, batch: int) -> bool:
        """Whether `batch` lies so far beyond the batches timed that its times are a line carried there."""
        return batch > EXTRAPOLATION_SAID * self.batches[-1]


def batches_for(batch: int) -> tuple[int, int]:
    """The micro batches to time a plan at `batch` with: the largest usual one and `batch` itself, so
    that the search run again prices `batch` as measured and anything between the two on a line
    through measurements on both sides."""
    return (TIMING_BATCHES[-1], batch)


def device_memory(device: torch.device) -> int | None:
    """Bytes of a GPU's memory; None for a CPU pool's host, where probes always fit."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def probe_fits(params: int, memory: int | None) -> bool:
    """Whether a probe may train `params` parameters on a device of `memory` bytes."""
    return memory is None or PROBE_BYTES_PER_PARAM * params < PROBE_FRACTION * memory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step(
    opt: torch.optim.Optimizer,
    device: torch.device,
    barrier: Callable[[], object] = lambda: None,
    slowest: Callable[[list[float]], list[float]] = lambda t: t,
) -> float:
    """Median seconds of the optimizer's step, after one that allocates its state (see measure_totals
    for `barrier` and `slowest`)."""
    opt.step()
    steps = []
    for _ in range(REPEATS):
        barrier()
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        steps += slowest([time.perf_counter() - t0])
    return statistics.median(steps)


def forward_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The training loss on `x` (its own tokens as targets: timing does not care what is predicted)."""
    return lm_loss(logits_of(model(x)), x)


def _time_pass(model: nn.Module, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward (with the loss) and of its backward (synchronised on CUDA)."""
    sync(device)
    t0 = time.perf_counter()
    loss = forward_loss(model, x)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def compute_copy(model: nn.Module, precision: str) -> nn.Module:
    """The model as FSDP2's mixed-precision policy computes it: its parameters in the compute dtype.

    Under bf16-mixed this is a bf16 copy and `model` stays the optimizer's fp32 master weights; they
    get zero gradients, as FSDP2 leaves fp32 gradients on them, so that the optimizer step does its work.
    """
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return model
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return copy.deepcopy(model).to(dtype)


def measure_totals(
    model: nn.Module,
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    barrier: Callable[[], object] = lambda: None,
    slowest: Callable[[list[float]], list[float]] = lambda t: t,
    precision: str = "fp32",
    optimizer: str = "adamw",
    compile: bool = False,
    batches: tuple[int, int] = TIMING_BATCHES,
) -> dict[str, Any]:
    """Whole-model medians: forward and backward seconds per timing batch (`batches`), what checkpointing
    every unit adds to them, optimizer seconds per parameter, in the training `precision`, with the
    runtime's `optimizer` and, under `compile`, compiled units (the warm-up round pays the compilation).

    Recomputation costs more than the forward it repeats where per-op host work counts (CPU: 1.5-2x
    on the tiny Llama), so it is timed: the passes are run again with every unit checkpointed as the
    runtime applies it. Plain passes first, then checkpointed ones: each kind in a row, as a run
    repeats one plan's step. The batches take turns, so a slow spell of a shared machine does not
    bend the fitted slope. `barrier` lines concurrent processes up before each pass, as a training
    step's collectives do, and `slowest` turns each rank's time into the slowest rank's (the step's).
    """
    compute = compute_copy(model, precision)
    units = [p for u in find_units(compute, seq_len) if u.name != ROOT for p in u.modules]
    if compile:
        compile_units(compute, units)
    inputs = {b: torch.randint(0, vocab_size, (b, seq_len), device=device) for b in batches}

    def medians(live: nn.Module) -> dict[int, tuple[float, float]]:
        runs: dict[int, list[list[float]]] = {b: [] for b in batches}
        for i in range(REPEATS + 1):
            for batch, x in inputs.items():
                barrier()
                timed = slowest(list(_time_pass(live, x, device)))
                if i:  # the first round warms up allocator and kernels
                    runs[batch].append(timed)
        return {b: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for b, rs in runs.items()}

    plain = medians(compute)
    checkpointed = [compute.get_submodule(p) for p in units]
    for module in checkpointed:
        checkpoint(module)
    recomputed = medians(compute)
    set_recomputing(checkpointed, False)  # in fp32 `compute` is the caller's model, timed plain after this
    totals: dict[str, Any] = {
        "forward": {str(b): f for b, (f, _) in plain.items()},
        "backward": {str(b): bw for b, (_, bw) in plain.items()},
        "recompute": {str(b): sum(recomputed[b]) - sum(plain[b]) for b in batches},
    }
    del compute
    opt = make_optimizer(model.parameters(), optimizer, device.type)
    totals["optimizer_s_per_param"] = median_step(opt, device, barrier, slowest) / sum(
        p.numel() for p in model.parameters()
    )
    return totals


def share_by_flops(totals: dict[str, Any], flops: dict[str, float]) -> MeasuredTimes:
    """Whole-pass times shared out by FLOPs (`flops`: unit -> forward FLOPs).

    Timings of single small units are noise on a busy CPU; the whole pass is stable, and a unit's
    share of it follows its share of the FLOPs. The lines run through the batches `totals` timed,
    clamped to be non-negative: where the line through them would start below zero, it runs from zero
    through the larger batch, the one a plan there is priced at.
    """
    b1, b2 = sorted(int(b) for b in totals["forward"])
    whole = sum(flops.values()) or 1.0

    def fit(kind: str) -> Linear1:
        at_larger = totals[kind][str(b2)]
        line = Linear1.fit(totals[kind][str(b1)], at_larger, b1, b2)
        if line.a < 0:  # steeper than proportional (caches overflow): the larger batch is priced as timed
            return Linear1(0.0, max(at_larger, 0.0) / b2)
        return Linear1(line.a, max(line.b, 0.0))

    fwd, bwd, rec = fit("forward"), fit("backward"), fit("recompute")
    checkpointable = {u: f for u, f in flops.items() if u != ROOT}  # the root is never checkpointed
    share = sum(checkpointable.values()) or 1.0
    return MeasuredTimes(
        {u: Linear1(fwd.a * f / whole, fwd.b * f / whole) for u, f in flops.items()},
        {u: Linear1(bwd.a * f / whole, bwd.b * f / whole) for u, f in flops.items()},
        totals["optimizer_s_per_param"],
        recompute={u: Linear1(rec.a * f / share, rec.b * f / share) for u, f in checkpointable.items()},
        batches=(b1, b2),
    )


def measure_times(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    flops: dict[str, float],
    precision: str = "fp32",
    optimizer: str = "adamw",
    world: int = 1,
    compile: bool = False,
    batches: tuple[int, int] = TIMING_BATCHES,
) -> MeasuredTimes:
    """Time the model in this process on `device` at the micro `batches`, in the training precision, with
    its optimizer and compilation; on a GPU also what FSDP2 adds for a rank of `world` (fsdp_probe)."""
    totals = measure_totals(
        build(str(device)),
        seq_len,
        vocab_size,
        device,
        precision=precision,
        optimizer=optimizer,
        compile=compile,
        batches=batches,
    )  # the model is freed before FSDP2's probe builds its sharded copies
    times = share_by_flops(totals, flops)
    if device.type != "cuda" or world == 1:  # a world of one runs no FSDP2 (runtime.apply)
        return times
    from osdp_planners.fsdp_probe import charge, measure_fsdp_costs  # it imports this module

    torch.cuda.empty_cache()
    plain_s = {b: totals["forward"][str(b)] + totals["backward"][str(b)] for b in batches}
    return charge(times, measure_fsdp_costs(build, seq_len, vocab_size, device, world, precision, plain_s, optimizer))
