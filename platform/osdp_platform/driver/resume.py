"""`submit --resume RUN_ID`: the checkpoint an earlier run recorded in MLflow, checked in the driver before Ray starts.

The driver's half of checkpointing (runtime/checkpoint.py is the workers'): it reads the MLflow run, so it
lives apart from the code a worker imports.
"""

from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_platform.recipe.schema import Recipe
from osdp_platform.tracking.records import recorded_checkpoint


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint `--resume RUN_ID` continues from, as recorded on that MLflow run."""

    run_id: str
    path: str
    step: int
    plan: Plan  # the plan the checkpoint was written under


def _is_complete(location: str) -> bool:
    """Whether a checkpoint folder (path or URI) holds DCP's `.metadata`, which rank 0 writes last."""
    if "://" not in location:
        return (Path(location) / ".metadata").is_file()
    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(location)
        return fs.get_file_info(f"{path}/.metadata").type == pyarrow.fs.FileType.File
    except (OSError, ValueError, pyarrow.ArrowException):
        return False


def find_resume_point(recipe: Recipe, run_id: str) -> ResumePoint:
    """Look up the last checkpoint of MLflow run `run_id` in the recipe's tracking store (before Ray starts)."""
    recorded = recorded_checkpoint(recipe.tracking.resolved_uri, run_id)
    if recorded is None:
        raise UserError(
            "--resume",
            run_id,
            "this run wrote no checkpoint",
            "resume a run submitted with train.checkpoint_every > 0 that got past its first "
            "checkpoint, or submit without --resume",
        )
    if not _is_complete(recorded.path):
        raise UserError(
            "--resume",
            run_id,
            f"its checkpoint folder {recorded.path} is gone or incomplete",
            "restore the checkpoint folder that run wrote (train.checkpoint_dir, default runs/), "
            "or submit without --resume",
        )
    if recipe.train.steps <= recorded.step:
        raise UserError(
            "train.steps",
            recipe.train.steps,
            f"the checkpoint of run {run_id} is already at step {recorded.step}",
            f"set train.steps above {recorded.step} to train further",
        )
    return ResumePoint(run_id, recorded.path, recorded.step, recorded.plan)


def check_resumable(point: ResumePoint, recipe: Recipe, structure_hash: str) -> None:
    """Refuse before planning what the checkpoint cannot load into: another model (`structure_hash`, of the
    recipe's model on meta). Any plan, worker count and split factors load it (model and optimizer state
    are saved under unsplit names)."""
    if point.plan.structure_hash != structure_hash:
        raise UserError(
            "model",
            recipe.model.label,
            f"run {point.run_id} trained a model with structure hash {point.plan.structure_hash}, "
            f"this recipe's model has {structure_hash}",
            "resume with the same model section as the checkpointed run",
        )
