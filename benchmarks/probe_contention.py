"""The planner's probe on a quiet host and on a busy one: what it records, and what it predicts.

Plans the tiny recipe with an empty probe cache, first on this host as it is, then beside as many
spinning processes as the host has cores (another job, or the test suite, on the same machine), and
trains the recipe once with `submit` on the quiet host, for the step both predictions are held to.
Prints a table and writes benchmarks/results/probe_contention.json.
Run: .venv/bin/python benchmarks/probe_contention.py [--steps 200]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from osdp_platform.driver.submit import submit
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "probe_contention.json"


def _plan(cache: Path, spinners: int) -> dict[str, Any]:
    """Plan the recipe with an empty cache at `cache`, beside `spinners` processes that spin."""
    os.environ["OSDP_CACHE_DIR"] = str(cache)
    rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    started = time.perf_counter()
    try:
        result = plan_recipe(load_recipe(RECIPE, []))
    finally:
        for rival in rivals:
            rival.kill()
            rival.wait()
    measured, comm = result.context.measured, result.context.topo.measured
    plan = result.plan
    return {
        "spinners": spinners,
        "model_probe_waited": measured.cpu_wait_share if measured else None,
        "comm_probe_waited": comm.cpu_wait_share if comm else None,
        "times_from": plan.predicted.times_from,
        "strategies": sorted({u.strategy.value for u in plan.units}),
        "predicted_step_s": plan.predicted.step_time_s,
        "plan_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="steps of the measured run")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        quiet, busy = Path(tmp) / "quiet", Path(tmp) / "busy"
        rows = [_plan(quiet, 0), _plan(busy, cores)]
        os.environ["OSDP_CACHE_DIR"] = str(quiet)  # the run's planner reads the quiet probe
        recipe = load_recipe(RECIPE, [f"train.steps={args.steps}", f"tracking.uri=sqlite:///{tmp}/m.db"])
        summary = submit(recipe, console=Console(quiet=True))
    aggregates = summary.measured()
    measured = aggregates["measured_step_time_s"]
    result = {
        "command": " ".join(["python benchmarks/probe_contention.py", *sys.argv[1:]]),
        "cores": cores,
        "steps": args.steps,
        "measured_step_s": measured,
        "measured_cpu_wait_share": aggregates.get("measured_cpu_wait_share"),
        "measured_strategies": sorted({u.strategy.value for u in summary.plan.units}),
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    waited = aggregates.get("measured_cpu_wait_share")
    table = Table(
        title=f"tiny recipe, {cores} cores; measured step over {args.steps} steps: {measured:.4f} s"
        + (f" (its ranks waited {waited:.0%} of a step for a CPU)" if waited is not None else "")
    )
    for col in ("spinning", "model probe waited", "comm probe waited", "plan", "predicted s", "pred / meas", "says"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            str(r["spinners"]),
            f"{r['model_probe_waited']:.0%}",
            f"{r['comm_probe_waited']:.0%}",
            "+".join(r["strategies"]),
            f"{r['predicted_step_s']:.4f}",
            f"{r['predicted_step_s'] / measured:.2f}",
            r["times_from"].split(":")[0],  # the whole sentence is in the JSON
        )
    Console().print(table)


if __name__ == "__main__":
    main()
