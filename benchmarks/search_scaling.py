"""Search time and memory against the number of sharding units, for the default search and the exact one.

A GPT at the OSDP paper's width (hidden 1536), 8 workers of one node, seq 1024, bf16, a fixed global batch
of 8 samples per rank (micro batches 1, 2, 4, 8), the full option space; depths from 4 to 5,000 layers (9 to
10,001 units). Each depth is profiled once (fake tensors); then `search_osdp` runs once per mode, timed,
and once more under tracemalloc for its peak of Python and numpy allocations (HiGHS's own memory is not
seen). `milp` runs only up to --milp-max-units (it is exact, and slow beyond). Prints a table and writes
benchmarks/results/search_scaling.json.
Run: .venv/bin/python benchmarks/search_scaling.py [--layers 4 24 96 480 2400 5000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

import osdp_planners.osdp as osdp
from osdp_planners import build_context
from osdp_planners.hardware import GIB, get_preset
from osdp_planners.request import PlanRequest
from osdp_platform.zoo import build_zoo_model

RESULTS = Path(__file__).resolve().parent / "results" / "search_scaling.json"


def request(layers: int, preset: str, memory_gb: float) -> PlanRequest:
    return PlanRequest(
        planner="osdp",
        model_label=f"gpt2-osdp-48l-{layers}l",
        nodes=1,
        workers_per_node=8,
        device=get_preset(preset),
        memory_limit_bytes=int(memory_gb * GIB),
        seq_len=1024,
        micro_batch_size=None,
        global_batch_size=8 * 8,
        precision="bf16-mixed",
    )


def measure(ctx: Any, req: PlanRequest, mode: str) -> dict[str, Any]:
    req = dataclasses.replace(req, search=mode)
    t = time.perf_counter()
    choice = osdp.search_osdp(ctx, req)
    seconds = time.perf_counter() - t
    tracemalloc.start()
    osdp.search_osdp(ctx, req)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report = None if choice is None else choice.report
    return {
        "mode": mode,
        "seconds": seconds,
        "python_peak_mib": peak / 2**20,
        "throughput": None if choice is None else choice.evaluation.throughput,
        "fastest_found": None if report is None else report.best.throughput_samples_per_s,
        "optimality_gap": None if report is None else report.optimality_gap,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 24, 96, 480, 2400, 5000])
    p.add_argument("--preset", default="a100-80gb")
    p.add_argument("--memory-gb", type=float, default=80.0)
    p.add_argument("--milp-max-units", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    rows = []
    for layers in args.layers:

        def build(device: str, n: int = layers) -> torch.nn.Module:
            with torch.device(device):
                return build_zoo_model("gpt2", "osdp-48l", n_layers=n)

        req = request(layers, args.preset, args.memory_gb)
        t = time.perf_counter()
        ctx = build_context(build, req, None)
        profiling = time.perf_counter() - t
        units = len(ctx.profile.units)
        modes = ["auto", "knapsack"] + (["milp"] if units <= args.milp_max_units else [])
        for mode in modes:
            r = {"layers": layers, "units": units, "profiling_s": profiling, **measure(ctx, req, mode)}
            rows.append(r)
            gap = "-" if r["optimality_gap"] is None else f"{r['optimality_gap']:.2%}"
            print(
                f"{layers:5d} layers {units:6d} units {mode:8s} {r['seconds']:8.2f} s "
                f"{r['python_peak_mib']:8.1f} MiB  {r['throughput'] or 0:9.2f} samples/s  gap {gap}",
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
