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
(inbox.py), which outlives the workers, and a restart loads the inbox's newest.

How resume finds them: once every rank's files are stored, the driver records the folder and the step to
continue at on the MLflow run (tracking/runs.py); `submit --resume RUN_ID` reads them back (driver/resume.py, the
driver's half: a worker never imports MLflow). DCP matches tensors by name and reshards on load, so a
checkpoint loads under another plan or worker count. Operator splitting renames parameters (`x.weight` ->
`x.slices.i.weight`): model and optimizer state are saved under the unsplit names and cut back into the live
slices on load, so a resume may also change split factors; `resume.check_resumable` refuses only another
model.
"""

import tempfile
from typing import Any

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
from torch.distributed.tensor import DTensor, distribute_tensor

from osdp_planners.split import SplitLinear


def should_save(step: int, every: int, steps: int) -> bool:
    """Save after every `every`-th step and after the last one (so a finished run can be extended)."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def _split_names(model: nn.Module) -> dict[str, tuple[list[str], SplitLinear]]:
    """Unsplit parameter name -> its slices' names and the SplitLinear, for every split Linear of `model`."""
    out: dict[str, tuple[list[str], SplitLinear]] = {}
    for path, module in model.named_modules():
        if isinstance(module, SplitLinear):
            prefix = f"{path}." if path else ""
            for leaf in ("weight", "bias"):
                if getattr(module.slices[0], leaf) is not None:
                    out[prefix + leaf] = ([f"{prefix}slices.{i}.{leaf}" for i in range(len(module.slices))], module)
    return out


def _is_rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0  # per-element state (moments), not a step count


def optim_unsplit(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every split Linear's slice entries joined under the unsplit name.

    Concatenating dim-0 shards of different slices is DTensor's `cat`, an all-gather: every rank holds
    the whole optimizer state of each split Linear while the result is alive (as for model state).
    """
    splits = _split_names(model)
    entries = dict(state["state"])
    for name, (slices, _) in splits.items():
        parts = [entries.pop(s) for s in slices if s in entries]
        if parts:
            entries[name] = {k: torch.cat([p[k] for p in parts]) if _is_rows(v) else v for k, v in parts[0].items()}
    renamed = {s: name for name, (slices, _) in splits.items() for s in slices}
    groups = [
        {**g, "params": list(dict.fromkeys(renamed.get(p, p) for p in g["params"]))} for g in state["param_groups"]
    ]
    return {"state": entries, "param_groups": groups}


def optim_split(model: nn.Module, state: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `optim_unsplit` for `model`'s split factors; `live` (slice names) gives each slice's layout."""
    splits = _split_names(model)
    entries = dict(state["state"])
    for name, (slices, module) in splits.items():
        if name not in entries:
            continue
        joined = entries.pop(name)
        for i, s in enumerate(slices):
            entries[s] = {
                k: _rows_like(v, module.rows, i, live["state"][s][k]) if _is_rows(v) else _own(v)
                for k, v in joined.items()
            }
    expand = {name: slices for name, (slices, _) in splits.items()}
    groups = [{**g, "params": [q for p in g["params"] for q in expand.get(p, [p])]} for g in state["param_groups"]]
    return {"state": entries, "param_groups": groups}


def _own(value: Any) -> Any:
    """A slice's own copy of a per-tensor value (Adam's step count is updated in place, once per slice)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _rows_like(value: torch.Tensor, rows: list[int], index: int, target: torch.Tensor) -> torch.Tensor:
    """Slice `index` of the full `value`, laid out as `target` (each rank cuts its own shard)."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    piece = torch.split(full, rows)[index]
    if isinstance(target, DTensor):
        return distribute_tensor(piece.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    return piece


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: torch.Tensor) -> dict[str, Any]:
    """What a checkpoint holds, all in unsplit names, so it loads under any split factor (`load_state`)."""
    return {
        "model": get_model_state_dict(model),
        "optim": optim_unsplit(model, get_optimizer_state_dict(model, optimizer)),
        "progress": {"step": step},
    }


def save_and_report(
    model: nn.Module, optimizer: torch.optim.Optimizer, next_step: int, metrics: dict[str, float], root: str
) -> str | None:
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
    with checkpoint.as_directory() as path:
        return load_state(model, optimizer, path)


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> int:
    """Load a DCP checkpoint folder into the live (sharded, maybe split) model and optimizer; its step."""
    step = torch.tensor(0)
    live = get_optimizer_state_dict(model, optimizer)
    state = {"model": get_model_state_dict(model), "optim": optim_unsplit(model, live), "progress": {"step": step}}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, optim_split(model, state["optim"], live))
    return int(step)
