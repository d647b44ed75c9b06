"""The per-worker training loop Ray Train runs: build, apply the plan, restore, train, send each step's metrics.

Rank 0 sends per-step metrics to the driver's inbox as each step ends (see inbox.py); Ray Train
hears from the loop only with a checkpoint: on a CPU pool the workers share cores with Ray, and a
report Ray Train handles every step would slow them. A CPU worker is pinned to a core of its own.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from osdp_planners.cpu_wait import WaitMeter
from osdp_planners.hardware import get_preset
from osdp_planners.local_ranks import pin_to_core
from osdp_planners.mfu import mfu, model_shape
from osdp_planners.plan import Plan
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.checkpoint import restore, save_and_report, should_save
from osdp_platform.runtime.inbox import CheckpointSaved, MetricsSender, StepReport, WorkersStarted
from osdp_platform.runtime.memory import measure_step_peak, reserved_peak
from osdp_platform.runtime.placement import machine_of_each_rank
from osdp_platform.runtime.state import build_worker_state

MAX_RANKS_LOGGED = 16  # per-rank metrics beyond this would flood the tracking store


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int | None  # measured on chosen steps only (see memory.py)
    reserved_memory_bytes: int | None = None  # CUDA: the allocator's reserved peak, max over ranks
    rank_step_time_s: list[float] = field(default_factory=list)
    rank_peak_memory_bytes: list[float] = field(default_factory=list)
    mfu: float | None = None  # GPU runs: per-device model FLOPs over the preset's peak (osdp_planners.mfu)
    cpu_wait_share: float | None = None  # the most any rank's step waited for a CPU (cpu_wait); None: unknown

    def as_dict(self) -> dict[str, float]:
        out = {"loss": self.loss, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s}
        if self.mfu is not None:
            out["mfu"] = self.mfu
        if self.cpu_wait_share is not None:
            out["cpu_wait_share"] = self.cpu_wait_share
        if self.peak_memory_bytes is not None:
            out["peak_memory_bytes"] = float(self.peak_memory_bytes)
        if self.reserved_memory_bytes is not None:
            out["reserved_memory_bytes"] = float(self.reserved_memory_bytes)
        if len(self.rank_step_time_s) <= MAX_RANKS_LOGGED:
            out |= {f"step_time_s/rank{r}": t for r, t in enumerate(self.rank_step_time_s)}
            out |= {f"peak_memory_bytes/rank{r}": m for r, m in enumerate(self.rank_peak_memory_bytes)}
        return out


def memory_probe_steps(steps: int, device_type: str) -> set[int]:
    """Steps whose peak memory is measured: all on CUDA; on CPU the 2nd (steady state) and the last."""
    if device_type == "cuda":
        return set(range(steps))
    return {min(1, steps - 1), steps - 1}


class WorkerConfig(BaseModel):
    """What the driver hands every worker through Ray Train."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    recipe: Recipe
    plan: Plan
    checkpoint_root: str  # Ray Train's storage_path (TrainSection.storage_root): where checkpoints go
    inbox: Any = None  # the driver's MetricsInbox actor handle (inbox.py); None: metrics are not sent
    resume_from: str | None = None  # an earlier run's checkpoint folder (submit --resume)
    elastic: bool = False  # after each checkpoint, stop if the driver asks to resize the group (driver/elastic.py)


@dataclass(frozen=True)
class StepTiming:
    """One step as every rank saw it. Its time is the slowest rank's (`max(times)`): the others wait
    for it at the next collective."""

    times: list[float]  # each rank's seconds
    peaks: list[float]  # each rank's peak memory in bytes (0 on a step without a memory probe)
    peak: int | None  # this rank's peak, None unprobed
    cpu_wait_share: float | None  # the most any rank waited for a CPU, as a share of its step; None: unknown


def _per_rank(values: list[float], world: int, device: torch.device) -> list[list[float]]:
    """Each of this rank's `values` as every rank has it (a straggler or an unbalanced shard shows up here)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [[float(t[i]) for t in gathered] for i in range(len(values))]


def timed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    one_step: Callable[[], None],
    device: torch.device,
    world: int,
    probe: bool,
    cpu_ranks: int = 1,
) -> StepTiming:
    """Run one step from a barrier, timed on every rank, with its peak memory where `probe`.

    How long each rank's thread waited for a CPU is measured beyond what `cpu_ranks` processes
    sharing this host's cores cause each other (a CPU pool's workers of one node). The benchmarks
    time plans with this same function.
    """
    dist.barrier()
    meter = WaitMeter()
    start = time.perf_counter()
    peak = measure_step_peak(model, optimizer, one_step, device) if probe else None
    if peak is None:
        one_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed, waited = time.perf_counter() - start, meter.share(cpu_ranks)
    times, peaks, waits = _per_rank([elapsed, float(peak or 0), -1.0 if waited is None else waited], world, device)
    return StepTiming(times, peaks, peak, None if min(waits) < 0 else max(waits))


def _reduce(value: float, op: dist.ReduceOp.RedOpType, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def resize_requested(inbox: Any, rank: int, device: torch.device) -> bool:
    """Whether the driver asked the group to stop for a resize: rank 0 asks the inbox, every rank hears its answer
    (all ranks leave the loop at the same step, right after a checkpoint, so no step is lost)."""
    import ray

    asked = rank == 0 and bool(ray.get(inbox.resize_requested.remote()))
    wanted = torch.tensor([int(asked)], dtype=torch.int64, device=device)
    dist.broadcast(wanted, src=0)
    return bool(wanted.item())


def train_loop(config: dict[str, Any], before_step: Callable[[int], None] | None = None) -> None:
    """Ray Train entry point; `config` is a WorkerConfig's fields.

    Starts from the newest checkpoint (see checkpoint.restore) at its step: the sampler is keyed by step,
    so the data continues exactly. `before_step(step)` runs before each step (wrappers use it, e.g. tests
    injecting a fault).
    """
    import ray
    import ray.train
    import ray.train.torch

    cfg = WorkerConfig.model_validate(config)
    recipe, plan = cfg.recipe, cfg.plan
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device() if recipe.hardware.accelerator == "gpu" else torch.device("cpu")
    if device.type == "cpu":
        pin_to_core(ctx.get_local_rank(), ctx.get_local_world_size())

    saved = ray.get(cfg.inbox.latest_checkpoint.remote()) if cfg.inbox is not None else None
    own = saved.path if saved else None
    state = build_worker_state(recipe, plan, device, partial(restore, own=own, resume_from=cfg.resume_from))
    model, optimizer, first = state.model, state.optimizer, state.first_step
    machines = machine_of_each_rank(ray.get_runtime_context().get_node_id())
    sender = MetricsSender(cfg.inbox) if rank == 0 and cfg.inbox is not None else None
    if sender is not None:
        sender.send(WorkersStarted(first, world, tuple(machines), plan.workers_per_node))
    probes = memory_probe_steps(recipe.train.steps, device.type)
    tokens_per_step = plan.global_batch_size * plan.seq_len
    flops_per_token = model_shape(model).flops_per_token(plan.seq_len)
    peak_flops = get_preset(recipe.hardware.preset).peak_flops_per_s if device.type == "cuda" else None
    cpu_ranks = ctx.get_local_world_size() if device.type == "cpu" else 1

    for step in range(first, recipe.train.steps):
        if before_step is not None:
            before_step(step)
        loss = 0.0

        def one_step(step: int = step) -> None:
            nonlocal loss
            loss = float(state.step(step, rank, world))

        timing = timed_step(model, optimizer, one_step, device, world, step in probes, cpu_ranks)
        peak = timing.peak
        reserved = reserved_peak(device) if peak is not None else None
        ended_ms = int(time.time() * 1000)  # MLflow shows when the step ran, not when the driver wrote it
        elapsed = max(timing.times)
        metrics = StepMetrics(
            step=step,
            loss=_reduce(loss, dist.ReduceOp.SUM, device) / world,
            step_time_s=elapsed,
            tokens_per_s=tokens_per_step / elapsed,
            peak_memory_bytes=int(max(timing.peaks)) if peak is not None else None,
            reserved_memory_bytes=None if reserved is None else int(_reduce(reserved, dist.ReduceOp.MAX, device)),
            rank_step_time_s=timing.times,
            rank_peak_memory_bytes=timing.peaks if peak is not None else [],
            mfu=mfu(tokens_per_step / elapsed / world, flops_per_token, peak_flops) if peak_flops else None,
            cpu_wait_share=timing.cpu_wait_share,
        )
        if sender is not None:
            sender.send(StepReport(step, ended_ms, metrics.as_dict()))
        if should_save(step, recipe.train.checkpoint_every, recipe.train.steps):
            path = save_and_report(model, optimizer, step + 1, metrics.as_dict(), cfg.checkpoint_root)
            if path is not None and sender is not None:
                sender.send(CheckpointSaved(step + 1, path))
            if cfg.elastic and cfg.inbox is not None and resize_requested(cfg.inbox, rank, device):
                break
    if sender is not None:
        sender.close()
    dist.barrier()
