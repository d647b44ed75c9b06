"""A budget that fits nothing gets advice; following it gives a plan that trains within that budget.

For each zoo family's tiny shape: plan under a budget far too small, read the minimum the error
advises, plan at exactly that budget, and train the plan for real on 2 gloo workers, measuring
each rank's peak with the platform's own step measurement (platform/osdp_platform/runtime/memory.py).
"""

import re
from typing import Any

import pytest
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue

from helpers import RECIPES
from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.memory import measure_step_peak
from osdp_platform.runtime.state import build_worker_state

pytestmark = pytest.mark.heavy

FAMILIES = ("llama", "gpt2", "opt")
GIB = 1024**3


def _peaks(config: dict[str, Any]) -> None:
    """Every family's plan, two steps each; the second step (steady state, optimizer states live) is measured."""
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    out: dict[str, float] = {}
    for family, (recipe_json, plan_json) in config["runs"].items():
        recipe, plan = Recipe.model_validate(recipe_json), Plan.model_validate(plan_json)
        state = build_worker_state(recipe, plan, torch.device("cpu"))
        state.step(0, rank, world)
        peak = measure_step_peak(
            state.model, state.optimizer, lambda s=state: s.step(1, rank, world), torch.device("cpu")
        )
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, peak)
        out[family] = max(gathered)
    if rank == 0:
        config["results"].put(out)


def _advised_budget(recipe: Recipe) -> float:
    with pytest.raises(UserError) as info:
        plan_recipe(recipe)
    found = re.search(r"at least ([0-9.]+) GiB", info.value.fix)
    assert found, f"the error gives no minimum: {info.value}"
    return float(found.group(1))


def test_training_at_the_advised_minimum_stays_within_it(ray_cluster: None) -> None:
    runs, budgets = {}, {}
    for family in FAMILIES:
        tight = load_recipe(
            RECIPES / "tiny.yaml",
            [
                f"model.family={family}",
                "data.seq_len=32",
                "train.micro_batch_size=2",
                "hardware.memory_per_device_gb=0.0001",
            ],
        )
        budgets[family] = _advised_budget(tight)
        at_minimum = tight.model_copy(
            update={"hardware": tight.hardware.model_copy(update={"memory_per_device_gb": budgets[family]})}
        )
        plan = plan_recipe(at_minimum).plan
        assert plan.predicted.peak_memory_bytes <= budgets[family] * GIB
        runs[family] = (at_minimum.model_dump(mode="json"), plan.model_dump(mode="json"))
    results = Queue(actor_options={"num_cpus": 0})
    TorchTrainer(
        _peaks, train_loop_config={"runs": runs, "results": results}, scaling_config=ScalingConfig(num_workers=2)
    ).fit()
    peaks = results.get(timeout=10)
    report = {f: f"{peaks[f] / GIB:.4f} of {budgets[f]:.4f} GiB" for f in FAMILIES}
    print(report)
    assert all(peaks[f] <= budgets[f] * GIB for f in FAMILIES), report
