"""OSDP's plan beside every uniform plan that fits, measured on real Ray Train gloo workers.

Plans every cell in this process with the shipped planner (benchmarks/cells.py), then starts one
TorchTrainer per world size whose loop builds every unique plan of a shape once and steps them in
interleaved rounds: in each round every plan takes a short turn (odd rounds in reverse order), each
step timed as the worker loop times a step (`osdp_platform.runtime.worker.timed_step`), a turn measured by
its median step. Adds the operator-splitting sweep, the paper's setups predicted with presets, the
search-time benchmark's last result and the issue's `submit` check, and writes benchmarks/RESULTS.md,
benchmarks/results/side_by_side.json and PNGs.
Run: .venv/bin/python benchmarks/side_by_side.py [--quick]
"""

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from cells import BUDGET_POINTS, SHAPES, Jobs, plan_cells, recipe_for, same_run, split_plans
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue
from results_md import write_report
from rich.console import Console

from osdp_planners.errors import UserError
from osdp_planners.local_ranks import pin_to_core
from osdp_planners.plan import Plan
from osdp_platform.driver.submit import submit
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.apply import Meshes
from osdp_platform.runtime.data import load_tokens
from osdp_platform.runtime.state import WorkerState, build_worker_state
from osdp_platform.runtime.worker import memory_probe_steps, timed_step
from osdp_platform.tracking.keys import Metric

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WARMUP_STEPS = 3  # a plan's first turn, untimed: Adam's states appear at step 0; memory probed at steps 1 and 2
WARMUP_ROUND = -1  # the round number the warm-up turn is sent under
SUBMIT_REPEATS = 4  # ddp/osdp pairs in the submit check, in alternating order (an even count balances it)
PAPER = {  # recipe, overrides, what the OSDP paper's research code published for the setup
    "GPT-2 48 layers / hidden 1536, 8 x RTX TITAN, 8 GB": ("gpt2.yaml", [], "1.22x over FSDP (published)"),
    "OPT-30B width, 8 layers, 8 x RTX TITAN, 16 GB": ("opt.yaml", [], "2.78x over FSDP (published)"),
    "Llama-2-7B, 8 x A100-80GB": ("llama.yaml", [], "-"),
    "Llama-2-70B, 64 x H100-80GB": ("llama-70b.yaml", ["hardware.preset=h100-80gb"], "-"),
}


@dataclass
class _Live:
    """One plan built once on this rank as a worker builds it, stepped turn by turn."""

    state: WorkerState
    done: int = 0  # steps taken so far


def _turn(live: _Live, steps: int, probes: set[int], rank: int, world: int) -> list[dict[str, float]]:
    """`steps` more steps of one plan, each timed as the worker loop times it; `probes` are turn-local
    indices of the steps whose peak memory is measured."""
    record: list[dict[str, float]] = []
    state = live.state
    for i in range(steps):
        losses: list[float] = []

        def one_step(step: int = live.done, losses: list[float] = losses) -> None:
            losses.append(float(state.step(step, rank, world)))

        timing = timed_step(state.model, state.optimizer, one_step, torch.device("cpu"), world, i in probes)
        record.append(
            {"step_time_s": max(timing.times), "loss": losses[0]}
            | ({"peak_memory_bytes": max(timing.peaks)} if timing.peak is not None else {})
        )
        live.done += 1
    return record


def _run_plans(config: dict[str, Any]) -> None:
    """Ray Train loop, shape by shape: build every plan of the shape once, warm each up (its memory
    probed as the worker loop probes a run), then `rounds` rounds in which every plan takes a turn of
    `turn_steps` steps, every other round in reverse order. Turns are short, so plans compared in a
    round ran seconds apart: the machine's drift, which moved whole runs by tens of percent, falls
    on both sides of a ratio. Rank 0 sends each turn's per-step metrics."""
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pin_to_core(ctx.get_local_rank(), ctx.get_local_world_size())
    recipes = {s: Recipe.model_validate(r) for s, r in config["recipes"].items()}
    meshes = Meshes("cpu", world, {})  # process groups made once, shared by every plan built here
    for shape in recipes:
        keys = [k for k, (s, _) in config["jobs"].items() if s == shape]
        live: dict[str, _Live] = {}
        tokens = load_tokens(recipes[shape].data, recipes[shape].train.seed)
        for key in keys:
            plan = Plan.model_validate_json(config["jobs"][key][1])
            live[key] = _Live(
                build_worker_state(recipes[shape], plan, torch.device("cpu"), meshes=meshes, tokens=tokens)
            )
            record = _turn(live[key], WARMUP_STEPS, memory_probe_steps(WARMUP_STEPS, "cpu"), rank, world)
            if rank == 0:
                config["results"].put((WARMUP_ROUND, key, record))
        for r in range(config["rounds"]):
            for key in keys if r % 2 == 0 else reversed(keys):
                record = _turn(live[key], config["turn_steps"], set(), rank, world)
                if rank == 0:
                    config["results"].put((r, key, record))
        del live
        gc.collect()


def _turn_measured(plan: Plan, warmup: list[dict[str, float]], turn: list[dict[str, float]]) -> dict[str, float]:
    """One turn's aggregates, named as `submit` names a run's: the median step time of the turn, the
    peak of the warm-up's probes."""
    step = statistics.median(s["step_time_s"] for s in turn)
    return {
        Metric.FIRST_LOSS: warmup[0]["loss"],
        Metric.FINAL_LOSS: turn[-1]["loss"],
        Metric.MEASURED_STEP_TIME: step,
        Metric.MEASURED_THROUGHPUT: plan.global_batch_size / step,
        Metric.MEASURED_PEAK_MEMORY: max(s["peak_memory_bytes"] for s in warmup if "peak_memory_bytes" in s),
    }


def measure(world: int, jobs: Jobs, rounds: int, turn_steps: int) -> dict[str, list[dict[str, float]]]:
    """One TorchTrainer for all of this world size's jobs; each job's measured aggregates per round."""
    recipes = {s: recipe_for(s, world, "ddp", 1).model_dump(mode="json") for s in dict.fromkeys(jobs.shape_of.values())}
    queue = Queue(actor_options={"num_cpus": 0})
    config = {
        "recipes": recipes,
        "rounds": rounds,
        "turn_steps": turn_steps,
        "results": queue,
        "jobs": {k: (jobs.shape_of[k], p.to_json()) for k, p in jobs.plans.items()},
    }
    TorchTrainer(_run_plans, train_loop_config=config, scaling_config=ScalingConfig(num_workers=world)).fit()
    warmup: dict[str, list[dict[str, float]]] = {}
    turns: dict[str, list[list[dict[str, float]]]] = {k: [] for k in jobs.plans}
    for _ in range((rounds + 1) * len(jobs.plans)):
        r, key, record = queue.get(timeout=60)
        if r == WARMUP_ROUND:
            warmup[key] = record
        else:
            turns[key].append(record)
    ray.kill(queue.actor)
    return {k: [_turn_measured(jobs.plans[k], warmup[k], t) for t in turns[k]] for k in jobs.plans}


def paper_setups() -> list[dict[str, Any]]:
    rows = []
    for label, (name, overrides, published) in PAPER.items():
        recipe = load_recipe(ROOT / "recipes" / name, ["planner.name=osdp", *overrides])
        plan = plan_recipe(recipe).plan
        fits = {k: b for k, b in plan.baselines.items() if b.fits and b.throughput_samples_per_s}
        best = max(fits, key=lambda k: fits[k].throughput_samples_per_s) if fits else None
        rows.append(
            {
                "setup": label,
                "command": f"osdp-platform plan recipes/{name} {' '.join(overrides)}".strip(),
                "preset": recipe.hardware.preset,
                "osdp_throughput": plan.predicted.throughput_samples_per_s,
                "osdp_mix": sorted({f"{u.strategy.value}({u.shard_group_size})x{u.split}" for u in plan.units}),
                "best_uniform": best,
                "best_uniform_throughput": fits[best].throughput_samples_per_s if best else None,
                "baselines": {k: b.model_dump() for k, b in plan.baselines.items()},
                "published": published,
            }
        )
    return rows


def submit_check(repeats: int, tmp: str) -> dict[str, Any]:
    """The issue's check: tiny at 1 GiB, ddp vs osdp, each run's measured step time; the order
    alternates (ddp first, then osdp first), so a drift over the benchmark favours neither. Also
    whether the two planners planned the same thing (then any gap is run-to-run noise)."""
    times: dict[str, list[float]] = {"ddp": [], "osdp": []}
    plans: dict[str, Plan] = {}
    for r in range(repeats):
        for name in sorted(times, reverse=r % 2 == 1):
            recipe = load_recipe(
                ROOT / "recipes" / "tiny.yaml",
                [f"planner.name={name}", "hardware.memory_per_device_gb=1", f"tracking.uri=sqlite:///{tmp}/bench-m.db"],
            )
            summary = submit(recipe, console=Console(quiet=True))
            times[name].append(summary.measured()["measured_step_time_s"])
            plans[name] = summary.plan
    return {"step_time_s": times, "same_plan": same_run(plans["ddp"], plans["osdp"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 workers, one shape, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed turns per plan (default 8, 3 with --quick)")
    parser.add_argument("--turn-steps", type=int, default=4, help="steps per turn")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for RESULTS.md and results/ (default: benchmarks/, or a temp folder with --quick)",
    )
    parser.add_argument("--report", type=Path, default=None, help="only re-render RESULTS.md from this JSON")
    args = parser.parse_args()
    if args.report:
        out = args.report.parent.parent
        write_report(json.loads(args.report.read_text()), out / "RESULTS.md", out / "results", "side_by_side")
        return
    rounds = args.rounds or (3 if args.quick else 8)
    worlds = (2,) if args.quick else (2, 4)
    shapes = ["llama-tiny"] if args.quick else list(SHAPES)
    split_shape = shapes[-1]  # the wide model in the full run
    console = Console()
    started = time.perf_counter()
    command = "python benchmarks/side_by_side.py" + (" --quick" if args.quick else "")
    result: dict[str, Any] = {
        "split_shape": split_shape,
        "command": command,
        "rounds": rounds,
        "turn_steps": args.turn_steps,
        "warmup_steps": WARMUP_STEPS,
        "worlds": list(worlds),
        "runs": {},
    }
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cells, split = [], {}
        for world in worlds:
            jobs = Jobs()
            t0 = time.perf_counter()
            world_cells = plan_cells(world, jobs, shapes)
            if world == 2:
                at = next(c for c in world_cells if c.shape == split_shape and c.budget_label == BUDGET_POINTS[1][0])
                split = split_plans(world, split_shape, at.budget_gb, jobs)
            console.print(
                f"world {world}: {len(world_cells)} cells, {len(jobs.plans)} unique plans, planned in "
                f"{time.perf_counter() - t0:.0f} s"
            )
            runs = measure(world, jobs, rounds, args.turn_steps)
            result["runs"][str(world)] = {
                k: {"plan": json.loads(jobs.plans[k].to_json()), "measured": v} for k, v in runs.items()
            }
            cells += [asdict(c) for c in world_cells]
            console.print(f"world {world}: measured, {time.perf_counter() - started:.0f} s so far")
        result["cells"], result["split"] = cells, {str(k): v for k, v in split.items()}
        result["paper"] = [] if args.quick else paper_setups()
        if not args.quick:
            with tempfile.TemporaryDirectory() as tmp:
                result["submit_check"] = submit_check(SUBMIT_REPEATS, tmp)
    except UserError as exc:
        console.print(f"[red]{exc}")
        raise SystemExit(2) from None
    finally:
        ray.shutdown()
    result["wall_s"] = time.perf_counter() - started
    search = HERE / "results" / "search_time.json"
    result["search_time"] = json.loads(search.read_text()) if search.is_file() else None
    out = args.out or (Path(tempfile.gettempdir()) / "osdp-side-by-side-quick" if args.quick else HERE)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "side_by_side.json").write_text(json.dumps(result, indent=1))
    write_report(result, out / "RESULTS.md", out / "results", "side_by_side")
    console.print(f"done in {result['wall_s']:.0f} s: {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
