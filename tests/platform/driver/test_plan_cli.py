"""`osdp-platform plan` end to end: large recipes on the meta device, reports, manual plans, infeasible budgets."""

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import CLI, RECIPES
from osdp_planners.plan import Plan, Strategy
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe

pytestmark = pytest.mark.heavy


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_llama_7b_zero3_plan_without_gpu_or_ray(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run_cli("plan", str(RECIPES / "llama.yaml"), "planner.name=zero3", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    plan = Plan.from_file(out)
    assert plan.world_size == 8 and len(plan.units) == 2 * 32 + 2  # attn + mlp per layer, embed, head
    assert {u.strategy for u in plan.units} == {Strategy.ZERO3}
    assert sum(u.param_count for u in plan.units) == 6_738_415_616
    assert plan.predicted.peak_memory_bytes is not None
    margin = plan.memory_margin  # a GPU pool's default: 5% of the budget and 1 GiB stay unplanned,
    assert margin is not None and (margin.fraction, margin.reserve_bytes) == (0.05, 1 << 30)
    assert margin.allocator_overhead == 0.25  # and the reserved peak is the allocated one x 1.25
    usable = margin.usable(plan.memory_limit_bytes)
    assert usable == pytest.approx((plan.memory_limit_bytes * 0.95 - (1 << 30)) / 1.25)
    assert plan.predicted.peak_memory_bytes <= usable
    assert plan.predicted.reserved_memory_bytes == int(plan.predicted.peak_memory_bytes * 1.25)
    assert "usable after a 5%" in result.stdout and "the allocator's 25%" in result.stdout
    assert plan.baselines["ddp"].fits is False  # 7B with AdamW replicated needs > 80 GB
    assert "best uniform plan" in result.stdout
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert not (tmp_path / "mlflow.db").exists()


GPU_RECIPES = sorted(p.name for p in RECIPES.glob("*.yaml") if load_recipe(p).hardware.accelerator == "gpu")


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_every_shipped_gpu_recipe_plans_offline(name: str) -> None:
    """A shipped recipe a user plans as written gets a plan (the GPU's allocator share once made the
    paper's recipes fit nothing). Knapsack: whether a plan fits does not depend on the search, and auto's
    MILP takes 13 s on opt.yaml."""
    result = plan_recipe(load_recipe(RECIPES / name, ["planner.search=knapsack"]))
    predicted = result.plan.predicted
    assert predicted.peak_memory_bytes is not None and predicted.reserved_memory_bytes is not None
    assert predicted.reserved_memory_bytes <= result.plan.memory_limit_bytes


def test_llama_70b_osdp_on_64_gpus(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = run_cli("plan", str(RECIPES / "llama-70b.yaml"), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    plan = Plan.from_file(out)
    assert (plan.nodes, plan.world_size) == (8, 64)
    assert plan.global_batch_size == 512
    assert all(64 % u.shard_group_size == 0 for u in plan.units)
    assert plan.predicted.peak_memory_bytes <= plan.memory_limit_bytes
    fitting = [b.throughput_samples_per_s for b in plan.baselines.values() if b.fits]
    # OSDP picks a simpler plan over one predicted less than 10% faster (osdp.NEAR_TIE)
    assert all(plan.predicted.throughput_samples_per_s * 1.10 >= t for t in fitting)
    # the default search proves a gap to every plan's bound, records it and prints it; how small it gets
    # depends on the solver's time limit on this machine, so the 1% target is benchmarks/search_70b.py's
    search = plan.search
    assert search is not None and search.optimality_gap is not None and search.throughput_upper_bound is not None
    best = search.best.throughput_samples_per_s
    assert best is not None and best <= search.throughput_upper_bound * (1 + 1e-9)
    assert best == pytest.approx(search.throughput_upper_bound * (1 - search.optimality_gap), rel=1e-6)
    assert f"proven within {search.optimality_gap:.2%}" in result.stdout


def test_manual_plan_is_evaluated_and_edits_change_predictions(tmp_path: Path) -> None:
    tiny, roomy = str(RECIPES / "tiny.yaml"), "hardware.memory_per_device_gb=0.1"  # replicated units fit 0.1 GB
    first = tmp_path / "zero3.json"
    made = run_cli(
        "plan", tiny, roomy, "--out", str(first), "planner.name=zero3", cwd=tmp_path
    )  # an override after --out
    assert made.returncode == 0, made.stderr[-2000:]
    assert '"units"' not in made.stdout and "zero3" in made.stdout  # the table, not the JSON
    data = json.loads(first.read_text())
    also = tmp_path / "also.json"
    printed = run_cli("plan", tiny, roomy, "planner.name=zero3", "--json", "--out", str(also), cwd=tmp_path)
    assert json.loads(printed.stdout)["units"] == data["units"], "stdout holds the plan alone"
    assert json.loads(also.read_text())["units"] == data["units"] and also.with_suffix(".png").stat().st_size > 0
    for unit in data["units"]:
        unit.update(strategy="ddp", shard_group_size=1)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    out = tmp_path / "manual.json"
    result = run_cli(
        "plan", tiny, roomy, "planner.name=manual", f"planner.plan_file={edited}", "--out", str(out), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manual = Plan.from_file(out)
    zero3 = Plan.from_file(first)
    assert {u.strategy for u in manual.units} == {Strategy.DDP}
    assert manual.predicted.peak_memory_bytes > zero3.predicted.peak_memory_bytes  # DP holds full copies


def _edited(plan: dict[str, Any], edit: str) -> dict[str, Any]:
    """The plan with one hand edit a user might make."""
    if edit == "split 3":
        plan["units"][1]["split"] = 3
    elif edit == "split a unit without Linears":
        plan["units"][0]["split"] = 2  # the embedding
    else:
        plan["micro_batch_size"] = 16
    return plan


@pytest.mark.parametrize(
    ("edit", "overrides", "said"),
    [
        ("split 3", [], ["planner.plan_file", "unit layers.0.attn:", "split 3", "use one of:"]),
        ("split a unit without Linears", [], ["planner.plan_file", "unit embed:", "split 2", "use one of:"]),
        ("micro batch 16", [], ["train.micro_batch_size = 8", "micro_batch_size 16", "set train.micro_batch_size=16"]),
        (
            "micro batch 16",
            ["train.micro_batch_size=auto"],
            ["planner.plan_file", "MiB per device, over the", "hardware.memory_per_device_gb = 0.008"],
        ),
        (
            "micro batch 16",
            ["train.micro_batch_size=auto", "hardware.memory_per_device_gb=0.1", "train.global_batch_size=16"],
            ["train.global_batch_size = 16", "16 x 1 x 2 = 32"],
        ),
    ],
)
def test_a_hand_edited_plan_the_pool_or_recipe_cannot_run_is_refused(
    tmp_path: Path, edit: str, overrides: list[str], said: list[str]
) -> None:
    """A split the profiler never measured, a split of a unit with nothing to split, a micro batch the
    recipe contradicts, a plan over the budget, a global batch the recipe contradicts: each is one
    message naming what is wrong, exit 2 (before, they planned, trained over the budget, or failed
    inside the memory model and blamed the model)."""
    tiny = str(RECIPES / "tiny.yaml")
    made = tmp_path / "zero3.json"
    assert run_cli("plan", tiny, "planner.name=zero3", "--out", str(made), cwd=tmp_path).returncode == 0
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(_edited(json.loads(made.read_text()), edit)))
    result = run_cli("plan", tiny, "planner.name=manual", f"planner.plan_file={edited}", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert all(s in result.stderr for s in said), result.stderr
    assert "Traceback" not in result.stderr and "errors.pydantic.dev" not in result.stderr


def test_infeasible_budget_names_the_smallest_footprint(tmp_path: Path) -> None:
    result = run_cli("plan", str(RECIPES / "llama.yaml"), "planner.memory_limit_gb=4", cwd=tmp_path)
    assert result.returncode == 2
    assert "smallest footprint" in result.stderr and "planner.memory_limit_gb" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_renamed_key_is_warned_of_on_the_terminal(tmp_path: Path) -> None:
    """The CLI keeps torch's FutureWarnings off the terminal, but not the platform's own (a renamed key),
    and shows it as one line, as its errors read."""
    result = run_cli("validate", str(RECIPES / "tiny.yaml"), "planner.search=dp", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.startswith("warning: planner.search=dp is renamed knapsack"), result.stderr
    assert "FutureWarning" not in result.stderr and "search: knapsack" in result.stdout
