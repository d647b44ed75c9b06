"""`sweep`: one recipe over a grid of overrides; plan every cell, train those that fit, compare them all.

`planner.name=osdp,zero3 train.micro_batch_size=4,8` is four cells. Every cell's recipe is validated
before anything starts. Each is planned on a sample worker, as submit would (cells on the same hardware
on one); a cell that does not fit is recorded as a plan run ("does not fit", with the planner's reason)
and not trained, the others train one after another through submit in one Ray session. Every run carries
the sweep's id, and the comparison printed at the end is read back from MLflow.
"""

import itertools
import uuid
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from osdp_planners import PlanResult
from osdp_planners.errors import NoPlanFits, UserError
from osdp_platform.driver.cluster import check_cluster, connect
from osdp_platform.driver.submit import ray_logs_hint, submit
from osdp_platform.planning.sample_worker import plan_on, sample_worker
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.preflight import preflight, where_it_runs
from osdp_platform.recipe.schema import Recipe
from osdp_platform.tracking.compare import Format, Row, compare
from osdp_platform.tracking.keys import RunKind, Tag
from osdp_platform.tracking.runs import RunTracker, check_reachable


def expand(overrides: list[str]) -> list[list[str]]:
    """The grid: each `key=a,b` takes every value in turn (the first such key varies slowest).
    A value that is a YAML list or mapping (`[a,b]`, `{a: 1, b: 2}`) stays one value."""
    choices = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or "," not in value or value.lstrip().startswith(("[", "{")):
            choices.append([item])
            continue
        values = [v.strip() for v in value.split(",")]
        if not key or not all(values):
            raise UserError(
                "override",
                item,
                "is not key=a,b,... (an empty key or value)",
                "write it as section.key=a,b, e.g. planner.name=osdp,zero3",
            )
        choices.append([f"{key}={v}" for v in values])
    return [list(cell) for cell in itertools.product(*choices)]


@dataclass
class Cell:
    label: str  # the overrides that vary across the grid
    recipe: Recipe
    planned: PlanResult | None = None
    problem: NoPlanFits | None = None  # why no plan fits


def _cells(recipe_path: str | Path, overrides: list[str]) -> list[Cell]:
    grid = expand(overrides)
    varying = [i for i in range(len(overrides)) if len({cell[i] for cell in grid}) > 1]
    cells = [Cell(" ".join(cell[i] for i in varying) or "(one cell)", load_recipe(recipe_path, cell)) for cell in grid]
    stores = {(c.recipe.tracking.resolved_uri, c.recipe.tracking.experiment) for c in cells}
    if len(stores) > 1:
        raise UserError(
            "tracking",
            sorted(stores),
            "a sweep records every cell in one MLflow experiment",
            "do not vary tracking.* across the grid",
        )
    return cells


def _plan_cells(cells: list[Cell], console: Console) -> None:
    """Plan every cell on a sample worker. Cells with the same hardware share one: its imports, and the
    profile of a model that several cells plan, are made once."""
    pools: dict[str, list[tuple[int, Cell]]] = {}
    for i, cell in enumerate(cells, 1):
        pools.setdefault(cell.recipe.hardware.model_dump_json(), []).append((i, cell))
    for pool in pools.values():
        with sample_worker(pool[0][1].recipe) as actor:
            for i, cell in pool:
                console.print(f"planning {i}/{len(cells)}: {cell.label}", markup=False)
                try:
                    cell.planned = plan_on(actor, cell.recipe)
                except NoPlanFits as exc:
                    cell.problem = exc
                    console.print(f"  does not fit: {exc.problem}", style="yellow", markup=False)


def sweep(
    recipe_path: str | Path,
    overrides: list[str],
    address: str | None = None,
    console: Console | None = None,
    fmt: Format = "table",
    verbose: bool = False,
) -> list[Row]:
    console = console or Console()
    cells = _cells(recipe_path, overrides)
    first = cells[0].recipe
    uri, experiment = first.tracking.resolved_uri, first.tracking.experiment
    for cell in cells:
        preflight(cell.recipe, where_it_runs(address))
    check_reachable(uri)
    connect([cell.recipe for cell in cells], address, verbose)  # a local Ray sized for the largest cell
    if not verbose:
        ray_logs_hint(console)
    for cell in cells:
        check_cluster(cell.recipe)
    tags: dict[str, str] = {Tag.SWEEP: uuid.uuid4().hex[:12]}
    console.print(f"sweep {tags[Tag.SWEEP]}: {len(cells)} cell(s) of {recipe_path}", markup=False)
    _plan_cells(cells, console)
    for cell in cells:
        if cell.problem is not None:
            tracker = RunTracker.start(cell.recipe, RunKind.PLAN, None, tags)
            tracker.note(f"{cell.label}: {cell.problem}")
            tracker.finish()
    for i, cell in enumerate(cells, 1):
        if cell.planned is None:
            continue
        console.print(f"training {i}/{len(cells)}: {cell.label}", markup=False)
        try:
            submit(cell.recipe, address, console, planned=cell.planned, tags=tags, verbose=verbose)
        except Exception as exc:  # a failed cell is recorded as failed; the others still run
            console.print(f"  failed: {exc}", style="red", markup=False)
    return compare(uri, [], experiment, fmt, console, sweep=tags[Tag.SWEEP], record=True)
