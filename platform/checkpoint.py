"""Checkpoints: the sharded model and optimizer state through torch.distributed.checkpoint (DCP).

Where they live: each rank writes its own DCP shard files into a local temp dir and reports it with
`ray.train.report`; Ray Train V2 copies every rank's files into one folder,
`<train.checkpoint_dir>/<name>-<runid8>/checkpoint_<next step>` (rank 0 adds DCP's `.metadata`).
`train.checkpoint_dir` is a path or a URI Ray Train's storage supports (s3://, gs://, ...), by
default `runs/` beside the driver; on a cluster it must be reachable from every worker, since a
restarted worker may run on another node. Ray Train keeps the newest `train.checkpoints_to_keep`. After a worker
failure Ray Train restarts the workers, but it registers a checkpoint only when its controller next
polls every worker (every 2 s): a worker that dies sooner after reporting loses it, and the restart
would begin again from step 0. So rank 0 also hands each stored folder to the driver's inbox
(progress.py), which outlives the workers, and a restart loads the inbox's newest.

How resume finds them: once every rank's files are stored, the driver tags the MLflow run with the
folder and the step to continue at (`checkpoint_path`, `checkpoint_step`); `submit --resume RUN_ID`
reads those tags. DCP matches tensors by name and reshards on load, so a checkpoint loads under another
plan or worker count as long as the parameter names agree. Operator splitting renames parameters
(`x.weight` -> `x.slices.i.weight`), in the optimizer state at least, so a resume must keep every
unit's split factor; `check_resumable` refuses other changes before training starts.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_platform.recipe import Recipe, TrainSection

CHECKPOINT_PATH_TAG = "checkpoint_path"
CHECKPOINT_STEP_TAG = "checkpoint_step"


@dataclass(frozen=True)
class CheckpointSaved:
    """Rank 0 -> driver: every rank's files for a checkpoint are in storage at `path`."""

    step: int  # the step training continues at
    path: str


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint `--resume RUN_ID` continues from, as recorded on that MLflow run."""

    run_id: str
    path: str
    step: int
    plan: Plan  # the plan the checkpoint was written under


def storage_root(train: TrainSection) -> str:
    """Ray Train's storage_path: the URI as given, a local path made absolute (workers run elsewhere)."""
    if train.checkpoint_dir and "://" in train.checkpoint_dir:
        return train.checkpoint_dir.rstrip("/")
    return str(Path(train.checkpoint_dir or "runs").expanduser().resolve())


def _is_complete(location: str) -> bool:
    """Whether a checkpoint folder (path or URI) holds DCP's `.metadata`, which rank 0 writes last."""
    if "://" not in location:
        return (Path(location) / ".metadata").is_file()
    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(location)
        return fs.get_file_info(f"{path}/.metadata").type == pyarrow.fs.FileType.File
    except (OSError, ValueError, pyarrow.ArrowException):
        return False


def should_save(step: int, every: int, steps: int) -> bool:
    """Save after every `every`-th step and after the last one (so a finished run can be extended)."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: torch.Tensor) -> dict[str, Any]:
    """What a checkpoint holds; DCP loads into these same objects in place."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
            "progress": {"step": step}}


def save_and_report(model: nn.Module, optimizer: torch.optim.Optimizer, next_step: int,
                    metrics: dict[str, float], root: str) -> str | None:
    """Write this rank's shards, report them to Ray Train; rank 0 returns the stored folder (a path or URI
    under `root`, Ray Train's storage_path) once every rank's files are there."""
    import ray.train
    from ray.train import Checkpoint

    name = f"checkpoint_{next_step:06d}"
    with tempfile.TemporaryDirectory(prefix="osdp-ckpt-") as tmp:
        dcp.save(_state(model, optimizer, torch.tensor(next_step)), checkpoint_id=tmp)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)
    dist.barrier()  # a synchronous report returns after this rank's upload: now every rank's files are stored
    if ray.train.get_context().get_world_rank() != 0:
        return None
    return f"{root}/{ray.train.get_context().get_experiment_name()}/{name}"


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, own: str | None, resume_from: str | None) -> int:
    """Load the newest state: this run's own checkpoint (`own`, from the inbox, else the one Ray Train
    registered), else `resume_from` (an earlier run's). Returns the step to continue at (0: nothing loaded).
    `own` and `resume_from` are paths or URIs; a remote checkpoint is downloaded to a temp folder first.
    """
    import ray.train
    from ray.train import Checkpoint

    checkpoint = Checkpoint(own) if own else ray.train.get_checkpoint()
    if checkpoint is None and resume_from:
        checkpoint = Checkpoint(resume_from)
    if checkpoint is None:
        return 0
    step = torch.tensor(0)
    state = _state(model, optimizer, step)
    with checkpoint.as_directory() as path:
        dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(step)


def find_resume_point(recipe: Recipe, run_id: str) -> ResumePoint:
    """Look up the last checkpoint of MLflow run `run_id` in the recipe's tracking store (before Ray starts)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = recipe.tracking.resolved_uri
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UserError("--resume", run_id, f"no MLflow run with this id in the tracking store {uri}",
                        "pass the run id that submit printed (MLflow run), with the same tracking.uri") from None
    tags = run.data.tags
    if CHECKPOINT_PATH_TAG not in tags:
        raise UserError("--resume", run_id, "this run wrote no checkpoint",
                        "resume a run submitted with train.checkpoint_every > 0 that got past its first "
                        "checkpoint, or submit without --resume")
    path = tags[CHECKPOINT_PATH_TAG]
    if not _is_complete(path):
        raise UserError("--resume", run_id, f"its checkpoint folder {path} is gone or incomplete",
                        "restore the checkpoint folder that run wrote (train.checkpoint_dir, default runs/), "
                        "or submit without --resume")
    step = int(tags[CHECKPOINT_STEP_TAG])
    if recipe.train.steps <= step:
        raise UserError("train.steps", recipe.train.steps, f"the checkpoint of run {run_id} is already at step {step}",
                        f"set train.steps above {step} to train further")
    with tempfile.TemporaryDirectory() as tmp:
        plan = Plan.from_file(client.download_artifacts(run_id, "plan.json", tmp))
    return ResumePoint(run_id, path, step, plan)


def check_resumable(point: ResumePoint, recipe: Recipe, plan: Plan) -> None:
    """Refuse before training what the checkpoint cannot load into: another model, renamed parameters."""
    if point.plan.structure_hash != plan.structure_hash:
        raise UserError("model", recipe.model.label,
                        f"run {point.run_id} trained a model with structure hash {point.plan.structure_hash}, "
                        f"this recipe's model has {plan.structure_hash}",
                        "resume with the same model section as the checkpointed run")
    saved = {u.name: u.split for u in point.plan.units}
    changed = sorted(f"{u.name} {saved[u.name]} -> {u.split}" for u in plan.units
                     if u.name in saved and u.split != saved[u.name])
    if changed:
        raise UserError("planner.name", recipe.planner.name,
                        f"this plan splits units differently from the checkpoint's ({', '.join(changed[:3])}"
                        f"{', ...' if len(changed) > 3 else ''}); splitting renames parameters and resuming "
                        "across split factors is not supported yet",
                        "resume with a plan that keeps every unit's split factor (a uniform planner, ddp, "
                        "zero2, zero3 or hsdp, when the checkpointed run split nothing)")
