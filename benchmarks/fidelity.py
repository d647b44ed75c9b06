"""Predicted vs measured on real gloo workers: peak memory and step time per planner.

Runs `submit` on the tiny recipe for each planner, `--repeats` rounds interleaved in one Ray session
(a shared machine drifts; medians over rounds compare), then times the same plans on bare gloo ranks
without Ray: the first column pair is what a user sees, the second isolates the cost model from the
runtime's own load on the workers' cores. Prints a table and writes benchmarks/results/fidelity.json.
Targets (issue 3): memory within 10%, step time within 25%.
Run: .venv/bin/python benchmarks/fidelity.py [--steps 30] [--repeats 3] [--micro 8,32,128 --out FILE]
"""

import argparse
import json
import platform as stdlib_platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from osdp_planners.local_ranks import run_ranks, slowest
from osdp_planners.plan import Plan
from osdp_platform.driver.submit import submit
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.data import load_tokens
from osdp_platform.runtime.state import build_worker_state

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "fidelity.json"
BARE_STEPS, BARE_WARMUP = 30, 5


def bare_rank(rank: int, world: int, args: list[str]) -> dict[str, float]:
    """Each plan's median step (slowest rank), as the worker loop times it, on plain gloo processes."""
    recipe = load_recipe(RECIPE, [])
    tokens = load_tokens(recipe.data, recipe.train.seed)
    out = {}
    for name, plan_json in json.loads(Path(args[0]).read_text()).items():
        state = build_worker_state(recipe, Plan.model_validate_json(plan_json), torch.device("cpu"), tokens=tokens)
        times = []
        for i in range(BARE_STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            state.step(i, rank, world)
            if i >= BARE_WARMUP:
                times += slowest([time.perf_counter() - t0])
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--planners", default="ddp,zero2,zero3,hsdp,osdp")
    parser.add_argument("--micro", default="8", help="micro batch sizes, comma-separated (the probe times 1 and 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    console = Console()
    cells = [(planner, int(micro)) for micro in args.micro.split(",") for planner in args.planners.split(",")]
    names = [f"{planner}@{micro}" for planner, micro in cells]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    plans: dict[str, Plan] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        for _ in range(args.repeats):
            for name, (planner, micro) in zip(names, cells, strict=True):
                recipe = load_recipe(
                    RECIPE,
                    [
                        f"planner.name={planner}",
                        f"train.micro_batch_size={micro}",
                        f"train.steps={args.steps}",
                        "hardware.memory_per_device_gb=1",
                        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                    ],
                )
                summary = submit(recipe, console=Console(quiet=True))
                runs[name].append(summary.measured())
                plans[name] = summary.plan
        ray.shutdown()
        plan_file = Path(tmp) / "plans.json"
        plan_file.write_text(json.dumps({n: p.to_json() for n, p in plans.items()}))
        bare = run_ranks("fidelity:bare_rank", plans[names[0]].world_size, [str(plan_file)])
    rows = [_row(planner, plans[n], runs[n], bare[n]) for n, (planner, _) in zip(names, cells, strict=True)]
    _print(console, rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": stdlib_platform.node(),
                "steps": args.steps,
                "repeats": args.repeats,
                "micro_batches": args.micro,
                "rows": rows,
            },
            indent=2,
        )
    )
    console.print(f"written {args.out}")


def _row(planner: str, plan: Plan, runs: list[dict[str, float]], bare_s: float) -> dict[str, Any]:
    pred = plan.predicted
    steps = [r["measured_step_time_s"] for r in runs]
    return {
        "planner": planner,
        "micro_batch": plan.micro_batch_size,
        "strategies": sorted({f"{u.strategy.value}/{u.shard_group_size}" for u in plan.units}),
        "predicted_step_time_s": pred.step_time_s,
        "measured_step_time_s": steps,
        "step_time_ratio_median": statistics.median(steps) / pred.step_time_s,
        "bare_step_time_s": bare_s,
        "bare_step_time_ratio": bare_s / pred.step_time_s,
        "predicted_peak_memory_bytes": pred.peak_memory_bytes,
        "measured_peak_memory_bytes": max(r["measured_peak_memory_bytes"] for r in runs),
        "peak_memory_ratio": max(r["measured_peak_memory_bytes"] for r in runs) / pred.peak_memory_bytes,
        "final_loss": runs[-1]["final_loss"],
    }


def _print(console: Console, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(
        title=f"tiny recipe, 2 gloo workers, {args.steps} steps x {args.repeats} rounds ({stdlib_platform.node()})"
    )
    for col in (
        "planner",
        "micro",
        "predicted step ms",
        "Ray runs ms",
        "Ray / predicted",
        "bare ranks ms",
        "bare / predicted",
        "peak MiB",
        "memory measured/predicted",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["planner"],
            str(r["micro_batch"]),
            f"{r['predicted_step_time_s'] * 1e3:.1f}",
            " ".join(f"{s * 1e3:.0f}" for s in r["measured_step_time_s"]),
            f"{r['step_time_ratio_median']:.2f}",
            f"{r['bare_step_time_s'] * 1e3:.1f}",
            f"{r['bare_step_time_ratio']:.2f}",
            f"{r['measured_peak_memory_bytes'] / 2**20:.2f}",
            f"{r['peak_memory_ratio']:.3f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
