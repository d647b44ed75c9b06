"""The side-by-side benchmark's plans, made in the driver with the shipped planner (`plan_recipe`).

A cell is one model shape at one memory budget on one world size. Its budgets come from the planner's
own predictions for uniform plans: the peak it predicts for DDP and for ZeRO-3 (planned at a budget
everything fits in), so "between ZeRO-3's need and DDP's" means what the planner itself believes.
Plans are deduplicated: a uniform plan that is the same at every budget is run once per repeat.
"""

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from osdp_planners.errors import UserError, UserErrors
from osdp_planners.margin import MemoryMargin
from osdp_planners.plan import Plan, Strategy
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
PLANNERS = ("osdp", "ddp", "zero2", "zero3", "hsdp")
UNIFORM = PLANNERS[1:]
GIB = 2**30
ROOMY_GB = 64  # a budget every plan of these small models fits in
# Overrides of recipes/tiny.yaml per shape. "wide": 2 layers, an MLP 8x the width, so its Linears dominate memory.
SHAPES: dict[str, list[str]] = {
    "llama-tiny": [],
    "gpt2-tiny": ["model.family=gpt2"],
    "wide": ["model.kwargs.dim=128", "model.kwargs.ffn_dim=1024"],
}
BUDGET_POINTS = (("DDP fits", 1.10), ("2/3 of the way to DDP", 2 / 3), ("1/3 of the way to DDP", 1 / 3))
SPLITS = (1, 2, 4, 8)


@dataclass
class Cell:
    world: int
    shape: str
    budget_label: str
    budget_gb: float
    plans: dict[str, str] = field(default_factory=dict)  # planner -> plan key (see Jobs)
    unfit: dict[str, str] = field(default_factory=dict)  # planner -> the planner's own reason


@dataclass
class Jobs:
    """Unique plans to run per world size, keyed by a short name; each job names its shape."""

    plans: dict[str, Plan] = field(default_factory=dict)
    shape_of: dict[str, str] = field(default_factory=dict)

    def add(self, shape: str, plan: Plan, name: str) -> str:
        for key, known in self.plans.items():
            if self.shape_of[key] == shape and same_run(known, plan):
                return key
        key = f"{shape}/{name}#{len(self.plans)}"
        self.plans[key], self.shape_of[key] = plan, shape
        return key


def same_run(a: Plan, b: Plan) -> bool:
    """Same batch and, unit by unit, the same modules, strategy, group, split and checkpointing:
    the workers would run exactly the same thing (whatever each planner predicted for it)."""

    def executed(p: Plan) -> tuple[object, ...]:
        units = [(u.name, u.modules, u.strategy, u.shard_group_size, u.split, u.checkpoint) for u in p.units]
        return p.micro_batch_size, p.grad_accum_steps, units

    return executed(a) == executed(b)


def recipe_for(shape: str, world: int, planner: str, budget_gb: float, extra: list[str] | None = None) -> Recipe:
    return load_recipe(
        RECIPE,
        [
            *SHAPES[shape],
            f"hardware.workers_per_node={world}",
            f"planner.name={planner}",
            f"hardware.memory_per_device_gb={budget_gb:.6f}",
            *(extra or []),
        ],
    )


def budgets(uniform: dict[str, Plan], margin: MemoryMargin) -> list[tuple[str, float]]:
    """The three budgets (GiB of device memory) from the planner's DDP and ZeRO-3 predicted peaks."""
    need = {s: uniform[s].predicted.peak_memory_bytes or 0 for s in ("ddp", "zero3")}
    out = []
    for label, frac in BUDGET_POINTS:
        usable = need["ddp"] * frac if frac > 1 else need["zero3"] + frac * (need["ddp"] - need["zero3"])
        out.append((label, margin.budget_for(usable) / 2**30))
    return out


def plan_cells(world: int, jobs: Jobs, shapes: list[str]) -> list[Cell]:
    """Uniform plans once per shape (the batch is fixed, so a uniform plan is the same at any budget it fits);
    OSDP per budget. Whether a uniform plan fits a budget is the planner's own verdict, the OSDP plan's
    `baselines` (the same simulation best_uniform runs)."""
    cells = []
    for shape in shapes:
        uniform = {s: plan_recipe(recipe_for(shape, world, s, ROOMY_GB)).plan for s in UNIFORM}
        margin = recipe_for(shape, world, "ddp", ROOMY_GB).memory_margin
        for label, gb in budgets(uniform, margin):
            cell = Cell(world, shape, label, gb)
            try:
                osdp = plan_recipe(recipe_for(shape, world, "osdp", gb)).plan
                cell.plans["osdp"] = jobs.add(shape, osdp, "osdp")
            except (UserError, UserErrors) as exc:
                cell.unfit["osdp"] = str(exc).splitlines()[0]
                osdp = None
            for name, plan in uniform.items():
                peak = plan.predicted.peak_memory_bytes or 0
                fits = osdp.baselines[name].fits if osdp and name in osdp.baselines else peak <= margin.usable(gb * GIB)
                if fits:
                    cell.plans[name] = jobs.add(shape, plan, name)
                else:
                    usable = margin.usable(gb * GIB)
                    cell.unfit[name] = f"predicted peak {peak / 2**20:.2f} MiB > usable {usable / 2**20:.2f} MiB"
            cells.append(cell)
    return cells


def split_plans(world: int, shape: str, budget_gb: float, jobs: Jobs) -> dict[int, str]:
    """ZeRO-3 with every splittable unit split k ways, predicted by the shipped manual planner."""
    result = plan_recipe(recipe_for(shape, world, "zero3", budget_gb))
    linear = result.context.profile.linear_bytes
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in SPLITS:
            units = [
                u.model_copy(update={"split": k}) if linear.get(u.name) and u.strategy is Strategy.ZERO3 else u
                for u in result.plan.units
            ]
            path = Path(tmp) / f"split{k}.json"
            path.write_text(result.plan.model_copy(update={"units": units}).to_json())
            manual = recipe_for(shape, world, "manual", budget_gb, [f"planner.plan_file={path}"])
            out[k] = jobs.add(shape, plan_recipe(manual).plan, f"zero3-split{k}")
    return out
