"""The default search at the recipes' scale: Llama-2-70B (recipes/llama-70b.yaml) on 16, 64 and 128 GPUs of
A100-80GB and on 64 of H100-80GB, against the exact search (`planner.search=milp`).

Per setup: profiling once, then `search_osdp` with the default search (auto) and with milp, each timed; the
plan's predicted samples/s, the fastest plan each found, the optimality gap each proved, and auto's
shortfall against milp's plan, and the machine's load average as each search started (timings on a shared
machine move with it). Plans only (meta device). Writes benchmarks/results/search_70b.json.
Run: .venv/bin/python benchmarks/search_70b.py [--skip-milp]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import osdp_planners.osdp as osdp
from osdp_planners import build_context
from osdp_planners.choice import describe
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.models import build_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "search_70b.json"
SETUPS = {
    "64 x A100-80GB (the recipe)": [],
    "64 x H100-80GB": ["hardware.preset=h100-80gb"],
    "16 x A100-80GB": ["hardware.nodes=2"],
    "128 x A100-80GB": ["hardware.nodes=16"],
}


def run(ctx: Any, req: Any, mode: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    t = time.perf_counter()
    choice = osdp.search_osdp(ctx, dataclasses.replace(req, search=mode))
    seconds = time.perf_counter() - t
    if choice is None or choice.report is None:
        return {"mode": mode, "seconds": seconds, "load_average": load, "fits": False}
    r = choice.report
    return {
        "mode": mode,
        "seconds": seconds,
        "load_average": load,
        "fits": True,
        "throughput": choice.evaluation.throughput,
        "peak_gib": choice.evaluation.peak_bytes / 2**30,
        "micro_batch": choice.micro_batch_size,
        "fastest_found": r.best.throughput_samples_per_s,
        "upper_bound": r.throughput_upper_bound,
        "optimality_gap": r.optimality_gap,
        "plan": describe(choice.options),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-milp", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    rows = []
    for label, overrides in SETUPS.items():
        recipe = load_recipe(ROOT / "recipes" / "llama-70b.yaml", overrides)
        req = plan_request(recipe)
        t = time.perf_counter()
        ctx = build_context(lambda dev, m=recipe.model: build_model(m, dev), req, None)
        row: dict[str, Any] = {"setup": label, "world_size": req.world_size, "profiling_s": time.perf_counter() - t}
        for mode in ["auto"] + ([] if args.skip_milp else ["milp"]):
            row[mode] = run(ctx, req, mode)
        auto, milp = row["auto"], row.get("milp")
        if milp and milp.get("fits") and auto.get("fits"):
            row["auto_vs_milp"] = auto["fastest_found"] / milp["fastest_found"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
