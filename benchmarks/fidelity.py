"""Predicted vs measured on real gloo workers: peak memory and step time per planner, one Ray session.

Runs `submit` on the tiny recipe for each planner (same machine, same run, so ratios compare),
prints a table and writes benchmarks/results/fidelity.json. Targets (issue 3): memory within 10%,
step time within 25%. Run: .venv/bin/python benchmarks/fidelity.py [--steps 12]
"""

import argparse
import json
import platform as stdlib_platform
import tempfile
from pathlib import Path

import ray
from rich.console import Console
from rich.table import Table

from osdp_platform.recipe_loader import load_recipe
from osdp_platform.submit import submit

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "fidelity.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--planners", default="ddp,zero2,zero3,hsdp,osdp")
    args = parser.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        for name in args.planners.split(","):
            recipe = load_recipe(RECIPE, [f"planner.name={name}", f"train.steps={args.steps}",
                                          "hardware.memory_per_device_gb=1",
                                          f"tracking.uri=sqlite:///{tmp}/mlflow.db"])
            m = submit(recipe, console=Console(quiet=True)).measured()
            plan_pred = m.get("step_time_ratio"), m.get("peak_memory_ratio")
            rows.append({"planner": name, **m, "step_time_ratio": plan_pred[0], "peak_memory_ratio": plan_pred[1]})
        ray.shutdown()
    table = Table(title=f"tiny recipe, 2 gloo workers, {args.steps} steps ({stdlib_platform.node()})")
    for col in ("planner", "measured step s", "step time measured/predicted", "peak MiB",
                "memory measured/predicted", "samples/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["planner"], f"{r['measured_step_time_s']:.4f}", f"{r['step_time_ratio']:.2f}",
                      f"{r['measured_peak_memory_bytes'] / 2**20:.2f}", f"{r['peak_memory_ratio']:.3f}",
                      f"{r['measured_throughput_samples_per_s']:.1f}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    console.print(f"written {RESULTS}")


if __name__ == "__main__":
    main()
