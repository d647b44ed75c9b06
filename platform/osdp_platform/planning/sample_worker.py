"""Plan on a sample worker: the planner actor, placed like one training worker, runs `local.plan_recipe` there."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from osdp_planners import PlanResult
from osdp_planners.errors import UserError
from osdp_platform.driver.cluster import pool_request
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.worker_env import worker_env

PLANNER_TIMEOUT_S = 600  # for planning, once the actor is placed (hardware.wait_for_nodes_s until then)


@ray.remote
class PlannerActor:
    """Runs the planner where a training worker would run, so profiling sees the workers' hardware."""

    def ready(self) -> None:
        """Answers once the actor runs: a node with the worker's resources was there, or was started."""

    def plan(self, recipe_json: dict[str, Any]) -> PlanResult:
        torch.set_num_threads(1)
        return plan_recipe(Recipe.model_validate(recipe_json))


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


@contextmanager
def sample_worker(recipe: Recipe) -> Iterator[Any]:
    """A planner actor placed like one training worker (same pool), and on a GPU with the workers' allocator
    settings (runtime.worker_env: the probe times the model as they run it); killed on leaving, which frees
    the worker again for training."""
    gpu = recipe.hardware.accelerator == "gpu"
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": int(gpu), "resources": pool_request(recipe.hardware)}
    if gpu:  # on CPU they change nothing, and a worker of its own would start slower than a pooled one
        options["runtime_env"] = {"env_vars": worker_env(os.environ)}
    actor = PlannerActor.options(**options).remote()  # type: ignore[attr-defined]  # ray.remote's class
    try:
        _wait_until_placed(actor, recipe)
        yield actor
    finally:
        ray.kill(actor)


def plan_on(actor: Any, recipe: Recipe) -> PlanResult:
    """The plan `actor` (a sample worker of `recipe`'s pool) makes, with what it was computed from, for the
    run's charts; the planner's UserError arrives whole."""
    try:
        result: PlanResult = ray.get(actor.plan.remote(recipe.model_dump(mode="json")), timeout=PLANNER_TIMEOUT_S)
    except RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise
    return result


def plan_on_sample_worker(recipe: Recipe) -> PlanResult:
    """Plan `recipe` on a sample worker started for it."""
    with sample_worker(recipe) as actor:
        return plan_on(actor, recipe)
