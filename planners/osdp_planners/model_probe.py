"""The model timed as a CPU pool's workers run it: its compute, and what FSDP2 adds to it per strategy.

Workers sharing a host's cores are slower than one process alone, so the model is timed on as many
concurrent single-threaded ranks as one node runs workers. The probe stacks of comm_probe give
the shape of FSDP2's costs (per unit, per tensor, per byte), but a real model's units cost more
than tiny ones: at every collective a rank waits for the others' compute, and copies grow with the
tensors. A CPU pool's model always fits the host, so the ranks also run it plain and under uniform
DP, ZeRO-2 and ZeRO-3; `calibrate` scales the probes' per-unit costs so that each uniform plan adds
what was measured, and mixed plans are charged unit by unit at those rates.
"""

import dataclasses
import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdp_planners.comm_probe import STRATEGIES, CommProfile, added_seconds, probe_meshes, shard_uniform
from osdp_planners.compute_probe import (
    TIMING_BATCHES,
    MeasuredTimes,
    compute_copy,
    forward_loss,
    measure_totals,
    share_by_flops,
)
from osdp_planners.cpu_wait import WaitMeter, quiet
from osdp_planners.disk_cache import cached
from osdp_planners.local_ranks import busiest_wait, run_ranks, slowest
from osdp_planners.options import Option
from osdp_planners.plan import Strategy
from osdp_planners.profile import ModelProfile
from osdp_planners.time_model import Topology, comm_seconds
from osdp_planners.units import ROOT, find_units

VERSION = 3  # of the cached measurement's format (2: timed in the training precision; 3: recomputation)
SCALE_RANGE = (0.5, 4.0)  # a calibration outside this is noise, not the model


@dataclass(frozen=True)
class ModelOverheads:
    """Seconds FSDP2 adds to this model on the pool's ranks, per uniform strategy."""

    step_added_s: dict[str, float]  # to forward+backward at the larger of the batches timed
    optimizer_added_s: dict[str, float]  # to the AdamW step


@dataclass(frozen=True)
class Training:
    """How the workers train: what the probe must time the model in."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    compile: bool = False


def _overheads(
    plain: nn.Module,
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    world: int,
    train: Training,
    batch: int,
) -> dict[str, Any]:
    """What each uniform strategy adds to `plain` (the model as timed, unsharded) at micro batch `batch`,
    both in the training precision: the casts of FSDP2's mixed-precision policy are among its costs."""
    meshes = probe_meshes(world)
    x = torch.randint(0, vocab_size, (batch, seq_len))
    compute = compute_copy(plain, train.precision)
    out: dict[str, dict[str, float]] = {"step_added_s": {}, "optimizer_added_s": {}}
    for strategy in STRATEGIES:
        sharded = build("cpu")
        units = [[sharded.get_submodule(m) for m in u.modules] for u in find_units(sharded, seq_len) if u.name != ROOT]
        shard_uniform(sharded, units, strategy, meshes, train.precision)
        step, opt = added_seconds(
            compute, sharded, lambda m: forward_loss(m, x).backward(), plain, optimizer=train.optimizer
        )
        out["step_added_s"][strategy], out["optimizer_added_s"][strategy] = step, opt
    return out


def measure_rank(_rank: int, world: int, args: list[str]) -> dict[str, Any]:
    import cloudpickle  # here, not at the top: a GPU node checked before Ray is installed lacks it

    with open(args[0], "rb") as f:
        build, seq_len, vocab_size, train, batches = cloudpickle.load(f)
    torch.manual_seed(0)
    meter = WaitMeter()
    model = build("cpu")
    cpu = torch.device("cpu")
    totals = measure_totals(
        model, seq_len, vocab_size, cpu, dist.barrier, slowest, train.precision, train.optimizer, train.compile, batches
    )
    overheads = _overheads(model, build, seq_len, vocab_size, world, train, batches[-1]) if world > 1 else None
    return {"totals": totals, "overheads": overheads, "cpu_wait_share": busiest_wait(meter, world)}


def measure_on_ranks(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    flops: dict[str, float],
    ranks: int,
    model_key: str,
    train: Training | None = None,
    batches: tuple[int, int] = TIMING_BATCHES,
) -> tuple[MeasuredTimes, ModelOverheads | None]:
    """Time the model on `ranks` concurrent CPU processes as the workers `train` it, at the micro
    `batches`; cached per model (`model_key`), shape, training settings, batches and ranks."""
    import cloudpickle  # see measure_rank

    train = train or Training()
    shape = f"{model_key}|{seq_len}|{vocab_size}|{batches}|{train.precision}|{train.optimizer}|{train.compile}"
    key = hashlib.sha256(shape.encode()).hexdigest()[:16]
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        cloudpickle.dump((build, seq_len, vocab_size, train, batches), f)
        f.flush()
        result = cached(
            f"model-v{VERSION}",
            f"{key}-r{ranks}",
            lambda: run_ranks("osdp_planners.model_probe:measure_rank", ranks, [f.name]),
            keep=quiet,
        )
    overheads = ModelOverheads(**result["overheads"]) if result["overheads"] else None
    times = dataclasses.replace(share_by_flops(result["totals"], flops), cpu_wait_share=result.get("cpu_wait_share"))
    return times, overheads


def calibrate(
    comm: CommProfile,
    overheads: ModelOverheads,
    profile: ModelProfile,
    topo: Topology,
    compute_bytes: int,
    optimizer_s_per_param: float,
) -> CommProfile:
    """The probes' costs (`comm`, in `topo`) rescaled so that each uniform plan of this model adds
    what was measured: FSDP2's per-unit costs by a scale per strategy, the optimizer's cost per
    DTensor from the measured difference less what sharding saves the plain per-parameter update."""
    lo, hi = SCALE_RANGE
    params = sum(profile.param_bytes.values()) / 4
    tensors = sum(profile.tensor_count.values())
    scale, per_tensor = {}, {}
    for name in STRATEGIES:
        strategy = Strategy(name)
        opt = Option(strategy, 1 if strategy is Strategy.DDP else topo.world_size)
        modelled = sum(comm_seconds(profile, u.name, opt, topo, compute_bytes) for u in profile.units)
        added = overheads.step_added_s[name] - comm.step_fixed_s
        scale[name] = min(max(added / modelled, lo), hi) if modelled > 0 else 1.0
        saved = params * optimizer_s_per_param * (1 - 1 / opt.shard_group_size)
        per_tensor[name] = max((overheads.optimizer_added_s[name] + saved) / tensors, 0.0)
    return dataclasses.replace(comm, scale=scale, optimizer_tensor_cost_s=per_tensor)
