"""Recipe to plan in this process, with no cluster: what `osdp-platform plan`, the planner actor and the
GPU check (benchmarks/gpu_check.py, run on nodes without Ray) share. Imports neither Ray nor MLflow."""

import os

import torch

from osdp_planners import PlanRequest, PlanResult, make_plan_for
from osdp_planners.hardware import get_preset
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.data import data_vocab_size
from osdp_platform.runtime.models import build_model


def plan_request(recipe: Recipe) -> PlanRequest:
    hw, t = recipe.hardware, recipe.train
    return PlanRequest(
        planner=recipe.planner.name,
        model_label=recipe.model.label,
        model_key=recipe.model.model_dump_json(),
        nodes=hw.node_counts[-1],  # an elastic pool's largest (submit plans each size it gets: recipe.at_nodes)
        workers_per_node=hw.workers_per_node,
        device=get_preset(hw.preset),
        memory_limit_bytes=recipe.memory_limit_bytes,
        budget_key=recipe.budget_key,
        margin=recipe.memory_margin,
        seq_len=recipe.data.seq_len,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        precision=t.precision,
        optimizer=t.optimizer,
        compile=t.compile,
        hsdp_group_size=recipe.planner.hsdp_group_size,
        plan_file=recipe.planner.plan_file,
        search=recipe.planner.search,
        prefer_simpler=recipe.planner.prefer_simpler,
        token_range=data_vocab_size(recipe.data),  # profile on the ids the tokenizer produces, not only bytes
    )


MEASURE_LIMIT_FRACTION = 0.2  # a CPU pool's model is timed only if its training states take under this share


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_device(recipe: Recipe, param_count: int) -> str | None:
    """Where this process can time the model for real: CPU pools here, GPU pools on a GPU of the preset's.

    The gate is the memory this process really has, not the recipe's budget: a tight planning
    budget must not switch measurement off. A GPU of the preset's kind times the model: whole where
    it fits, else block by block (osdp_planners.block_probe). Another GPU (`plan` on a workstation
    for an H100 pool) would time the wrong device: the times then come from the preset, as offline.
    """
    states = 16 * param_count  # fp32 params, grads and two AdamW moments
    if recipe.hardware.accelerator == "cpu":
        return "cpu" if states < MEASURE_LIMIT_FRACTION * _host_memory_bytes() else None
    preset = get_preset(recipe.hardware.preset)
    return "cuda" if torch.cuda.is_available() and preset.describes(torch.cuda.get_device_name()) else None


def plan_recipe(recipe: Recipe) -> PlanResult:
    """Plan from the model on meta and fake tensors (any size, no accelerator); time it where it fits."""
    meta = build_model(recipe.model, device="meta")
    device = measure_device(recipe, sum(p.numel() for p in meta.parameters()))
    return make_plan_for(lambda dev: build_model(recipe.model, dev), plan_request(recipe), measure_on=device)
