"""Measured communication on a CPU pool: gloo collectives and FSDP2's own costs, on real processes.

On CPU every collective blocks and FSDP2's Python hooks and DTensor dispatch cost as much as the
bytes moved, so presets cannot predict a step. This starts `world` gloo processes on this host (the
workers of a CPU pool are processes like these) and measures:
- bus bandwidth of all-gather, reduce-scatter and all-reduce on a large tensor;
- per strategy, what FSDP2 adds to forward+backward over the same model unsharded, on stacks of
  tiny units (U units of k tensors each, bytes negligible), fitted as
  `step_fixed + U * (unit + k * tensor)`: a cost per step (the root), per unit and per tensor;
- per strategy, what the optimizer step over DTensors adds per parameter tensor.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from osdp_planners.cpu_wait import WaitMeter, quiet
from osdp_planners.disk_cache import cached
from osdp_planners.local_ranks import busiest_wait, run_ranks, slowest
from osdp_planners.runtime import make_optimizer, mp_policy

LARGE = 4 << 20  # bytes of the bandwidth probes
WIDTH, REPEATS = 16, 15
SHAPES = ((2, 1), (2, 4), (6, 1), (6, 4))  # (units, tensors per unit) of the probe stacks
STRATEGIES = ("ddp", "zero2", "zero3")
VERSION = 3  # bump when the fields change: cached files of another version are measured again


@dataclass(frozen=True)
class CommProfile:
    world_size: int
    bandwidth: dict[str, float]  # all_gather / reduce_scatter / all_reduce -> bus bytes per second
    unit_cost_s: dict[str, float]  # strategy -> seconds one FSDP2 unit adds to forward+backward
    tensor_cost_s: dict[str, float]  # strategy -> seconds each parameter tensor of a unit adds
    optimizer_tensor_cost_s: dict[str, float]  # strategy -> seconds a DTensor adds to the optimizer step
    step_fixed_s: float  # seconds FSDP2 adds once per forward+backward (root hooks, lazy state)
    scale: dict[str, float] = field(default_factory=dict)  # strategy -> per-unit costs x this for one model
    cpu_wait_share: float | None = None  # of the probe's time its busiest rank waited for a CPU (cpu_wait)


def _median_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _stack(units: int, tensors: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(tensors))) for _ in range(units))
    )


def added_seconds(
    plain: nn.Module,
    sharded: nn.Module,
    step: Callable[[nn.Module], object],
    plain_master: nn.Module | None = None,
    optimizer: str = "adamw",
) -> tuple[float, float]:
    """Median seconds FSDP2 adds to forward+backward (`step`) and to an optimizer step, plain and sharded
    runs interleaved so that drift in the machine's speed cancels out of each difference; each time
    is the slowest rank's. Under mixed precision `plain` is the compute copy and `plain_master` holds
    the fp32 weights its optimizer steps (compute_probe.compute_copy)."""
    models = (plain, sharded)
    opts = [make_optimizer(m.parameters(), optimizer, "cpu") for m in (plain_master or plain, sharded)]
    step_diffs, opt_diffs = [], []
    for i in range(REPEATS + 1):
        steps, updates = [], []
        for model, opt in zip(models, opts, strict=True):
            dist.barrier()
            t0 = time.perf_counter()
            step(model)
            t1 = time.perf_counter()
            opt.step()
            steps.append(t1 - t0)
            updates.append(time.perf_counter() - t1)
        steps, updates = slowest(steps), slowest(updates)
        if i:  # the first round builds FSDP2's lazy state and the optimizer's moments
            step_diffs.append(steps[1] - steps[0])
            opt_diffs.append(updates[1] - updates[0])
    return statistics.median(step_diffs), statistics.median(opt_diffs)


def probe_meshes(world: int, device_type: str = "cpu") -> dict[str, DeviceMesh]:
    """DP replicates over a (world, 1) mesh, as the runtime applies it; ZeRO shards over all ranks."""
    return {
        "ddp": init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "shard")),
        "zero": init_device_mesh(device_type, (world,), mesh_dim_names=("shard",)),
    }


def shard_uniform(
    model: nn.Module,
    units: list[list[nn.Module]],
    strategy: str,
    meshes: dict[str, DeviceMesh],
    precision: str = "fp32",
) -> nn.Module:
    """Every unit (its modules) under one strategy, the root over the rest, in the training precision."""
    mesh = meshes["ddp" if strategy == "ddp" else "zero"]
    mp = mp_policy(precision)
    for modules in units:
        unit = modules if len(modules) > 1 else modules[0]
        fully_shard(unit, mesh=mesh, reshard_after_forward=strategy == "zero3", mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def _tiny_step(model: nn.Module) -> None:
    model(torch.ones(4, WIDTH)).sum().backward()


def _fit(rows: list[tuple[float, ...]], values: list[float]) -> list[float]:
    """Least-squares coefficients, clamped non-negative (a cost is never a saving)."""
    coef = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64), torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    ).solution
    return [max(float(c), 0.0) for c in coef.squeeze(1)]


def _fsdp_costs(world: int) -> dict[str, object]:
    meshes = probe_meshes(world)
    unit, tensor, opt_tensor, fixed = {}, {}, {}, []
    for strategy in STRATEGIES:
        added = {}
        for shape in SHAPES:
            sharded = _stack(*shape)
            shard_uniform(sharded, [[u] for u in sharded], strategy, meshes)
            added[shape] = added_seconds(_stack(*shape), sharded, _tiny_step)
        step, per_unit, per_tensor = _fit([(1.0, u, u * k) for u, k in SHAPES], [added[s][0] for s in SHAPES])
        fixed.append(step)
        unit[strategy], tensor[strategy] = per_unit, per_tensor
        opt_tensor[strategy] = _fit([(1.0, u * k) for u, k in SHAPES], [added[s][1] for s in SHAPES])[1]
    return {
        "unit_cost_s": unit,
        "tensor_cost_s": tensor,
        "optimizer_tensor_cost_s": opt_tensor,
        "step_fixed_s": statistics.median(fixed),
    }


def bandwidths(world: int) -> dict[str, float]:
    """Bus bytes per second of each collective on about LARGE bytes: every rank's part the same size,
    the whole `world` parts (a world that does not divide LARGE's floats, 3 or 6, gathers a few less)."""
    part = torch.zeros(LARGE // 4 // world)
    full = torch.zeros(part.numel() * world)
    bus = (world - 1) / world * full.numel() * full.element_size()
    return {
        "all_gather": bus / _median_time(lambda: dist.all_gather_into_tensor(full, part)),
        "reduce_scatter": bus / _median_time(lambda: dist.reduce_scatter_tensor(part, full)),
        "all_reduce": 2 * bus / _median_time(lambda: dist.all_reduce(full)),
    }


def measure_rank(_rank: int, world: int, _args: list[str]) -> dict[str, Any]:
    meter = WaitMeter()
    bandwidth = bandwidths(world)
    costs = _fsdp_costs(world)
    return {"world_size": world, "bandwidth": bandwidth, **costs, "cpu_wait_share": busiest_wait(meter, world)}


def cached_comm(world_size: int) -> CommProfile:
    """Measured once per host, torch version and world size (what it depends on), then read from disk."""

    def measure() -> dict[str, Any]:
        return run_ranks("osdp_planners.comm_probe:measure_rank", world_size, [])

    return CommProfile(**cached(f"comm-v{VERSION}", f"w{world_size}", measure, keep=quiet))
