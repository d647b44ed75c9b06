"""Turn a recipe into a plan: locally (the `plan` command) or in the planner actor on a sample worker."""

import json
import os
from dataclasses import fields, is_dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from osdp_planners import PlanRequest, PlanResult, make_plan_for
from osdp_planners.errors import UserError
from osdp_planners.hardware import get_preset
from osdp_platform.cluster import pool_request
from osdp_platform.data import data_vocab_size
from osdp_platform.models import build_model
from osdp_platform.recipe import Recipe

PLANNER_TIMEOUT_S = 600  # for planning, once the actor is placed (hardware.wait_for_nodes_s until then)


def plan_request(recipe: Recipe) -> PlanRequest:
    hw, t = recipe.hardware, recipe.train
    return PlanRequest(
        planner=recipe.planner.name,
        model_label=recipe.model.label,
        model_key=recipe.model.model_dump_json(),
        nodes=hw.nodes,
        workers_per_node=hw.workers_per_node,
        device=get_preset(hw.preset),
        memory_limit_bytes=recipe.memory_limit_bytes,
        margin=recipe.memory_margin,
        seq_len=recipe.data.seq_len,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        precision=t.precision,
        optimizer=t.optimizer,
        hsdp_group_size=recipe.planner.hsdp_group_size,
        plan_file=recipe.planner.plan_file,
        search=recipe.planner.search,
        prefer_simpler=recipe.planner.prefer_simpler,
        token_range=data_vocab_size(recipe.data),  # profile on the ids the tokenizer produces, not only bytes
    )


MEASURE_LIMIT_FRACTION = 0.2  # time the model for real only if its training states take under this share


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_device(recipe: Recipe, param_count: int) -> str | None:
    """Where this process can time the model for real: CPU pools here, GPU pools on a GPU worker.

    The gate is the memory this process really has, not the recipe's budget: a tight planning
    budget must not switch measurement off.
    """
    states = 16 * param_count  # fp32 params, grads and two AdamW moments
    if recipe.hardware.accelerator == "cpu":
        return "cpu" if states < MEASURE_LIMIT_FRACTION * _host_memory_bytes() else None
    if torch.cuda.is_available() and states < MEASURE_LIMIT_FRACTION * torch.cuda.get_device_properties(0).total_memory:
        return "cuda"
    return None


def plan_recipe(recipe: Recipe) -> PlanResult:
    """Plan from the model on meta and fake tensors (any size, no accelerator); time it where it fits."""
    meta = build_model(recipe.model, device="meta")
    device = measure_device(recipe, sum(p.numel() for p in meta.parameters()))
    return make_plan_for(lambda dev: build_model(recipe.model, dev), plan_request(recipe), measure_on=device)


@ray.remote
class PlannerActor:
    """Runs the planner where a training worker would run, so profiling sees the workers' hardware."""

    def ready(self) -> None:
        """Answers once the actor runs: a node with the worker's resources was there, or was started."""

    def plan(self, recipe_json: dict[str, Any]) -> PlanResult:
        torch.set_num_threads(1)
        return plan_recipe(Recipe.model_validate(recipe_json))


def _jsonable(obj: Any) -> Any:
    """Dataclasses as dicts, like dataclasses.asdict, but a key that is not a string (a profile's
    Variant) is written as its repr, since JSON keys are strings."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else repr(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def profile_json(result: PlanResult) -> str:
    """What the plan was computed from (profile, measured times, collectives), for the run's artifacts."""
    ctx = result.context
    return json.dumps(
        {
            "profile": _jsonable(ctx.profile),
            "measured_compute": _jsonable(ctx.measured),
            "measured_comm": _jsonable(ctx.topo.measured),
            "device": _jsonable(ctx.topo.device),
        },
        indent=1,
        default=str,
    )


def _wait_until_placed(actor: Any, recipe: Recipe) -> None:
    """A pool that never appears (a name no node group advertises) is the user's to fix, not a timeout."""
    hw = recipe.hardware
    try:
        ray.get(actor.ready.remote(), timeout=hw.wait_for_nodes_s)
    except GetTimeoutError:
        need = [
            "1 CPU",
            *(["1 GPU"] if hw.accelerator == "gpu" else []),
            *([f"1 unit of {hw.pool_resource!r}"] if hw.pool_resource else []),
        ]
        field, value = (
            ("hardware.pool", hw.pool) if hw.pool_resource else ("hardware.wait_for_nodes_s", hw.wait_for_nodes_s)
        )
        raise UserError(
            field,
            value,
            f"no node with {' and '.join(need)} free was there for the planner within {hw.wait_for_nodes_s:g} s "
            "(hardware.wait_for_nodes_s)",
            "name a pool a node group of the cluster advertises (KubeRay: the worker group's `resources`; "
            "`ray status` lists them), set hardware.pool=any to run on any node, or give a slow autoscaler more "
            "time with hardware.wait_for_nodes_s",
        ) from None


def plan_on_sample_worker(recipe: Recipe) -> PlanResult:
    """Place the planner actor like one training worker (same pool), get its plan (with what it was computed from, for
    the run's charts), and free the worker again."""
    gpu = 1 if recipe.hardware.accelerator == "gpu" else 0
    options = {"num_cpus": 1, "num_gpus": gpu, "resources": pool_request(recipe.hardware)}
    actor = PlannerActor.options(**options).remote()  # type: ignore[attr-defined]  # ray.remote's class
    try:
        _wait_until_placed(actor, recipe)
        result = ray.get(actor.plan.remote(recipe.model_dump(mode="json")), timeout=PLANNER_TIMEOUT_S)
    except RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise
    finally:
        ray.kill(actor)
    return result
