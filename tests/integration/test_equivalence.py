"""Numerical equivalence: plans trained on real gloo workers match one process fed the same global batch.

One TorchTrainer.fit per world size runs every case in turn (each fit costs ~20 s of start-up). A case is
a model, a plan and an optimizer; the workers build it as `train_loop` does (meta device, plan, then
initialised shard by shard, see meta_init.py), report per-step losses and the full parameters gathered at
the end (unsplit names), and the driver compares them with an unsharded model trained by plain PyTorch.

AdamW normalises each gradient element, so it hides a gradient scaled by a constant (a wrong reduction
divisor); the SGD case (every strategy, 4-way split slices) catches those: a 1% scale error moves its
loss by ~1e-3 relative. The AdamW learning rate is small because GPT-2's key bias has a gradient that
is zero in exact arithmetic (softmax ignores a per-row shift), which Adam turns from rounding noise
into steps of up to lr: at lr 1e-3 that alone differed by 1.3e-5 between sharded and reference runs.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from osdp_planners.plan import Plan, Strategy, UnitPlan
from osdp_planners.uniform import group_size, uniform_plan
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.schema import ModelSection, Recipe
from osdp_platform.runtime.apply import PlanMismatch, apply_plan
from osdp_platform.runtime.data import load_tokens
from osdp_platform.runtime.models import build_model, build_sharded
from osdp_platform.runtime.state import build_worker_state
from reference import reference_run

pytestmark = pytest.mark.heavy

STEPS = 5
MICRO_BATCH = 2
SEQ_LEN = 16
LR = {"adamw": 1e-4, "sgd": 0.1}
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

LLAMA = {"family": "llama", "size": "tiny"}
GPT2 = {"family": "gpt2", "size": "tiny", "kwargs": {"n_layers": 1}}  # head tied to the token embedding
# Rows that divide by neither 2 nor 4 workers, nor by split factors 3 and 4: vocab 257, k/v 30, ffn 150.
ODD = {
    "family": "llama",
    "size": "tiny",
    "kwargs": {"n_layers": 1, "vocab_size": 257, "dim": 60, "n_heads": 6, "n_kv_heads": 3, "ffn_dim": 150},
}
MIXED = (Strategy.ZERO3, Strategy.DDP, Strategy.ZERO2, Strategy.HSDP)
RELOAD_FROM = "odd-split2"  # its trained parameters are loaded into other splits of the same model:
RELOAD = "reload-split3"  # from the full (gathered) state dict
RELOAD_DCP = "reload-dcp-split4"  # from a sharded DCP checkpoint


@dataclass(frozen=True)
class Case:
    model: dict[str, Any]
    plan: Plan
    optimizer: str = "adamw"


def _recipe(world: int, optimizer: str = "adamw") -> Recipe:
    return Recipe.model_validate(
        {
            "model": LLAMA,
            "data": {"source": "corpus", "seq_len": SEQ_LEN},
            "hardware": {"workers_per_node": world},
            "planner": {"name": "zero3"},
            "train": {
                "steps": STEPS,
                "micro_batch_size": MICRO_BATCH,
                "optimizer": optimizer,
                "lr": LR[optimizer],
                "weight_decay": 0.01,
            },
        }
    )


def _plan(
    recipe: Recipe, model: dict[str, Any], strategies: tuple[Strategy, ...], split: int = 1, checkpoint_every: int = 0
) -> Plan:
    """A uniform plan edited unit by unit: strategies cycle over the units, every n-th is checkpointed."""
    req = plan_request(recipe)
    base = uniform_plan(build_model(ModelSection.model_validate(model), "meta"), req, strategies[0], MICRO_BATCH, 1)
    units: list[UnitPlan] = []
    for i, unit in enumerate(base.units):
        strategy = strategies[i % len(strategies)]
        units.append(
            unit.model_copy(
                update={
                    "strategy": strategy,
                    "shard_group_size": group_size(strategy, req),
                    "split": split,
                    "checkpoint": bool(checkpoint_every) and i % checkpoint_every == 0,
                }
            )
        )
    return Plan.model_validate({**base.model_dump(), "units": [u.model_dump() for u in units]})


def _cases(recipe: Recipe) -> dict[str, Case]:
    cases = {s.value: Case(LLAMA, _plan(recipe, LLAMA, (s,))) for s in Strategy}
    cases["mixed-ckpt"] = Case(LLAMA, _plan(recipe, LLAMA, MIXED, checkpoint_every=2))
    cases["odd-zero3"] = Case(ODD, _plan(recipe, ODD, (Strategy.ZERO3,)))
    cases[RELOAD_FROM] = Case(ODD, _plan(recipe, ODD, (Strategy.ZERO3, Strategy.HSDP), split=2))
    cases["gpt2-tied-mixed-split2"] = Case(
        GPT2, _plan(recipe, GPT2, (Strategy.HSDP, Strategy.DDP, Strategy.ZERO2), split=2, checkpoint_every=2)
    )
    cases["odd-mixed-split4-ckpt-sgd"] = Case(ODD, _plan(recipe, ODD, MIXED, split=4, checkpoint_every=3), "sgd")
    return cases


def _train_cases(config: dict[str, Any]) -> None:
    """Worker loop: each case from the same seed and data; rank 0 sends losses and full parameters."""
    import ray.train

    torch.set_num_threads(1)
    recipes = {name: Recipe.model_validate(r) for name, r in config["recipes"].items()}
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    seed = recipes["adamw"].train.seed
    tokens = load_tokens(recipes["adamw"].data, seed)
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    results: dict[str, dict[str, Any]] = {}
    for name, (model_json, plan_json, optimizer_name) in config["cases"].items():
        start = time.perf_counter()
        recipe = recipes[optimizer_name].model_copy(update={"model": ModelSection.model_validate(model_json)})
        state = build_worker_state(recipe, Plan.model_validate(plan_json), torch.device("cpu"), tokens=tokens)
        model = state.model
        losses = []
        for step in range(STEPS):
            mean = state.step(step, rank, world)
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        results[name] = {
            "losses": losses,
            "params": get_model_state_dict(model, options=full_options),
            "seconds": time.perf_counter() - start,
        }
        if name == RELOAD_FROM:
            results.update(_reload(model, model_json, config, seed))
    dist.barrier()
    if rank == 0:
        config["results"].put(results)


def _reload(
    model: nn.Module, model_json: dict[str, Any], config: dict[str, Any], seed: int
) -> dict[str, dict[str, Any]]:
    """Load `model`'s parameters into differently split copies, by full state dict and through DCP."""

    def fresh(name: str) -> nn.Module:
        torch.manual_seed(seed + 1)
        return build_sharded(
            ModelSection.model_validate(model_json),
            Plan.model_validate(config["reload_plans"][name]),
            torch.device("cpu"),
        )

    full = StateDictOptions(full_state_dict=True)
    from_full = fresh(RELOAD)
    set_model_state_dict(from_full, get_model_state_dict(model, options=full), options=full)
    dcp.save(get_model_state_dict(model), checkpoint_id=config["dcp_dir"])
    from_dcp = fresh(RELOAD_DCP)
    sharded = get_model_state_dict(from_dcp)
    dcp.load(sharded, checkpoint_id=config["dcp_dir"])
    set_model_state_dict(from_dcp, sharded)
    gather = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        RELOAD: {"params": get_model_state_dict(from_full, options=gather)},
        RELOAD_DCP: {"params": get_model_state_dict(from_dcp, options=gather)},
    }


def _reference(model_json: dict[str, Any], recipe: Recipe, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = ModelSection.model_validate(model_json)
    return reference_run(lambda: build_model(model), recipe, MICRO_BATCH * world, STEPS)


def _max_param_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert list(got) == list(expected), set(got) ^ set(expected)
    return max(float((got[k] - expected[k]).abs().max()) for k in expected)


@pytest.mark.parametrize("world", [2, 4])
def test_plans_match_single_process_reference(ray_cluster: None, world: int, tmp_path: Path) -> None:
    recipes = {opt: _recipe(world, opt) for opt in LR}
    cases = _cases(recipes["adamw"])
    reload_plans = {
        RELOAD: _plan(recipes["adamw"], ODD, (Strategy.HSDP, Strategy.ZERO2), split=3),
        RELOAD_DCP: _plan(recipes["adamw"], ODD, (Strategy.DDP, Strategy.ZERO3), split=4),
    }
    queue = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        _train_cases,
        train_loop_config={
            "recipes": {opt: r.model_dump(mode="json") for opt, r in recipes.items()},
            "cases": {n: (c.model, c.plan.model_dump(mode="json"), c.optimizer) for n, c in cases.items()},
            "reload_plans": {n: p.model_dump(mode="json") for n, p in reload_plans.items()},
            "dcp_dir": str(tmp_path / "dcp"),
            "results": queue,
        },
        scaling_config=ScalingConfig(num_workers=world),
    )
    start = time.perf_counter()
    trainer.fit()
    results = queue.get(timeout=30)
    fit_seconds = time.perf_counter() - start

    references: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}
    report, failed = [], []
    for name, case in cases.items():
        key = f"{case.model} {case.optimizer}"
        if key not in references:
            references[key] = _reference(case.model, recipes[case.optimizer], world)
        ref_losses, ref_params = references[key]
        losses = results[name]["losses"]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        param_diff = _max_param_diff(results[name]["params"], ref_params)
        report.append(
            f"{name}: loss rel {loss_diff:.1e}, params abs {param_diff:.1e} ({results[name]['seconds']:.1f} s)"
        )
        if loss_diff > LOSS_RTOL or param_diff > PARAM_ATOL:
            failed.append(name)
    source = results[RELOAD_FROM]["params"]
    for name in (RELOAD, RELOAD_DCP):
        reloaded = results[name]["params"]
        diff = _max_param_diff(reloaded, references[f"{ODD} adamw"][1])
        report.append(f"{name}: params abs {diff:.1e}")
        if diff > PARAM_ATOL or not all(torch.equal(reloaded[k], source[k]) for k in source):
            failed.append(name)
    print(f"\n{world} workers, fit {fit_seconds:.0f} s\n" + "\n".join(report))
    assert not failed, "\n".join(report)
    sgd_losses = references[f"{ODD} sgd"][0]
    assert sgd_losses[-1] < 0.9 * sgd_losses[0], "the SGD reference did not learn"


def test_plan_for_another_model_is_refused() -> None:
    """apply_plan checks the structure before touching any mesh, so no process group is needed."""
    plan = _plan(_recipe(2), LLAMA, (Strategy.ZERO3,))
    with pytest.raises(PlanMismatch, match="structure hash"):
        apply_plan(build_model(ModelSection.model_validate(GPT2), "meta"), plan, "cpu")
    fewer_units = plan.model_copy(update={"units": plan.units[:-1]})
    with pytest.raises(PlanMismatch, match="not this model's units"):
        apply_plan(build_model(ModelSection.model_validate(LLAMA), "meta"), fewer_units, "cpu")
