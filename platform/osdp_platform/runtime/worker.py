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

from osdp_planners.hardware import get_preset
from osdp_planners.local_ranks import pin_to_core
from osdp_planners.mfu import mfu, model_shape
from osdp_planners.plan import Plan
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.checkpoint import restore, save_and_report, should_save
from osdp_platform.runtime.inbox import CheckpointSaved, MetricsSender, StepReport, WorkersStarted
from osdp_platform.runtime.memory import measure_step_peak, reserved_peak
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

    def as_dict(self) -> dict[str, float]:
        out = {"loss": self.loss, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s}
        if self.mfu is not None:
            out["mfu"] = self.mfu
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


def _per_rank(elapsed: float, peak: int | None, world: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Every rank's step time and peak memory (a straggler or an unbalanced shard shows up here)."""
    mine = torch.tensor([elapsed, float(peak or 0)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [float(t[0]) for t in gathered], [float(t[1]) for t in gathered]


def timed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    one_step: Callable[[], None],
    device: torch.device,
    world: int,
    probe: bool,
) -> tuple[list[float], list[float], int | None]:
    """Run one step from a barrier: every rank's time and peak memory, and this rank's peak (None unprobed).

    The step's time is the slowest rank's (`max` of the first list): the others wait for it at the
    next collective. The benchmarks time plans with this same function.
    """
    dist.barrier()
    start = time.perf_counter()
    peak = measure_step_peak(model, optimizer, one_step, device) if probe else None
    if peak is None:
        one_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times, peaks = _per_rank(time.perf_counter() - start, peak, world, device)
    return times, peaks, peak


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
    sender = MetricsSender(cfg.inbox) if rank == 0 and cfg.inbox is not None else None
    if sender is not None:
        sender.send(WorkersStarted(first, world))
    probes = memory_probe_steps(recipe.train.steps, device.type)
    tokens_per_step = plan.global_batch_size * plan.seq_len
    flops_per_token = model_shape(model).flops_per_token(plan.seq_len)
    peak_flops = get_preset(recipe.hardware.preset).peak_flops_per_s if device.type == "cuda" else None

    for step in range(first, recipe.train.steps):
        if before_step is not None:
            before_step(step)
        loss = 0.0

        def one_step(step: int = step) -> None:
            nonlocal loss
            loss = float(state.step(step, rank, world))

        times, peaks, peak = timed_step(model, optimizer, one_step, device, world, step in probes)
        reserved = reserved_peak(device) if peak is not None else None
        ended_ms = int(time.time() * 1000)  # MLflow shows when the step ran, not when the driver wrote it
        elapsed = max(times)
        metrics = StepMetrics(
            step=step,
            loss=_reduce(loss, dist.ReduceOp.SUM, device) / world,
            step_time_s=elapsed,
            tokens_per_s=tokens_per_step / elapsed,
            peak_memory_bytes=int(max(peaks)) if peak is not None else None,
            reserved_memory_bytes=None if reserved is None else int(_reduce(reserved, dist.ReduceOp.MAX, device)),
            rank_step_time_s=times,
            rank_peak_memory_bytes=peaks if peak is not None else [],
            mfu=mfu(tokens_per_step / elapsed / world, flops_per_token, peak_flops) if peak_flops else None,
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
