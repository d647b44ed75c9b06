"""How long the OSDP search takes on a 96-layer GPT over the full option space, and what it finds.

Profiles the model once (fake tensors, no accelerator), then times `search_osdp` alone: every unit
x every strategy/HSDP group x split 1/2/4/8 x checkpointing, at 8 micro batch sizes (a fixed global
batch of 128 samples per rank: micro batches 1..128 with accumulation 128..1). Prints a table and
writes benchmarks/results/search_time.json. Target: the search in under 1 s on a 2-core machine.
Run: .venv/bin/python benchmarks/search_time.py [--layers 96] [--preset rtx-titan-24gb] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform as stdlib_platform
import pstats
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import osdp_planners.osdp as osdp
from osdp_planners import build_context
from osdp_planners.choice import Choice
from osdp_planners.evaluate import Context
from osdp_planners.hardware import GIB, PRESETS, get_preset
from osdp_planners.plan import Strategy
from osdp_planners.request import PlanRequest
from osdp_planners.search import bound, quantum_for
from osdp_planners.space import batch_candidates, unit_option_lists
from osdp_planners.uniform import best_uniform
from osdp_platform.zoo import build_zoo_model

RESULTS = Path(__file__).resolve().parent / "results" / "search_time.json"
TARGET_S = 1.0
PHASES = ("search_candidates", "solve", "evaluate")  # names search_osdp calls, timed by wrapping them


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="gpt2")
    p.add_argument("--size", default="osdp-48l", help="zoo size whose width is used (osdp-48l: hidden 1536)")
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--preset", default="rtx-titan-24gb", choices=sorted(PRESETS))
    p.add_argument("--memory-gb", type=float, default=None, help="per-device limit in GiB (default: the preset's)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--workers-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--per-rank-batch", type=int, default=128, help="samples per rank per step (global / world)")
    p.add_argument("--precision", default="bf16-mixed", choices=["fp32", "bf16-mixed"])
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the search (median reported)")
    p.add_argument("--profile", action="store_true", help="also run the search under cProfile and print the top")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def make_request(args: argparse.Namespace) -> PlanRequest:
    device = get_preset(args.preset)
    limit = device.memory_bytes if args.memory_gb is None else int(args.memory_gb * GIB)
    world = args.nodes * args.workers_per_node
    return PlanRequest(
        planner="osdp",
        model_label=f"{args.family}-{args.size}-{args.layers}l",
        nodes=args.nodes,
        workers_per_node=args.workers_per_node,
        device=device,
        memory_limit_bytes=limit,
        seq_len=args.seq_len,
        micro_batch_size=None,
        global_batch_size=args.per_rank_batch * world,
        precision=args.precision,
    )


@contextmanager
def phase_timers() -> Iterator[dict[str, float]]:
    """Wrap the functions search_osdp calls by name, accumulating their wall time."""
    spent = dict.fromkeys(PHASES, 0.0)
    originals = {name: getattr(osdp, name) for name in PHASES}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    for name, fn in originals.items():
        setattr(osdp, name, timed(name, fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(osdp, name, fn)


def space(ctx: Context, req: PlanRequest) -> dict[str, Any]:
    """Size of what the search looks at: units, options per unit, batch candidates."""
    per_unit = [len(opts) for opts in unit_option_lists(ctx, req).values()]
    batches = batch_candidates(req)
    return {
        "units": len(per_unit),
        "options_per_unit_max": max(per_unit),
        "options_total": sum(per_unit),
        "micro_batches": [b for b, _ in batches],
        "candidates_scored": sum(per_unit) * len(batches),
        "params": sum(u.param_count for u in ctx.profile.units),
    }


def search_bound(ctx: Context, choice: Choice) -> float:
    """The search's memory bound for the chosen options (what solve kept under the limit)."""
    units = list(choice.options)
    cands = osdp.search_candidates(
        ctx, units, {u: [o] for u, o in choice.options.items()}, choice.micro_batch_size, choice.grad_accum_steps
    )
    return bound(cands, [0] * len(cands), quantum_for(ctx.usable_memory_bytes))


def plan_summary(ctx: Context, req: PlanRequest, choice: Choice) -> dict[str, Any]:
    ev = choice.evaluation
    mix = Counter(
        f"{o.strategy.value}/g{o.shard_group_size}/split{o.split}{'/ckpt' if o.checkpoint else ''}"
        for o in choice.options.values()
    )
    uniform = {}
    for s in Strategy:
        found = best_uniform(ctx, req, s)
        uniform[s.value] = (
            None
            if found is None
            else {"micro_batch": found.micro_batch_size, "throughput": found.evaluation.throughput}
        )
    fastest_uniform = max((u["throughput"] for u in uniform.values() if u), default=None)
    return {
        "micro_batch": choice.micro_batch_size,
        "grad_accum": choice.grad_accum_steps,
        "peak_gib": ev.peak_bytes / GIB,
        "bound_gib": search_bound(ctx, choice) / GIB,
        "limit_gib": ctx.usable_memory_bytes / GIB,
        "step_time_s": ev.step_time_s,
        "throughput": ev.throughput,
        "mix": dict(mix.most_common()),
        "uniform": uniform,
        "vs_best_uniform": None if fastest_uniform is None else ev.throughput / fastest_uniform,
    }


def top_of_profile(ctx: Context, req: PlanRequest, n: int = 18) -> str:
    prof = cProfile.Profile()
    prof.runcall(osdp.search_osdp, ctx, req)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def main() -> None:
    args = parse()
    console = Console()
    req = make_request(args)

    def build(device: str) -> torch.nn.Module:
        with torch.device(device):
            return build_zoo_model(args.family, args.size, n_layers=args.layers)

    t = time.perf_counter()
    ctx = build_context(build, req, None)
    profiling_s = time.perf_counter() - t

    runs = []
    choice = None
    for _ in range(args.repeats):
        t = time.perf_counter()
        choice = osdp.search_osdp(ctx, req)
        runs.append(time.perf_counter() - t)
    with phase_timers() as phases:
        t = time.perf_counter()
        osdp.search_osdp(ctx, req)
        phases_total = time.perf_counter() - t
    search_s = statistics.median(runs)

    result: dict[str, Any] = {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("profile", "out")
        },
        "machine": {
            "node": stdlib_platform.node(),
            "cpus": os.cpu_count(),
            "python": stdlib_platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "space": space(ctx, req),
        "profiling_s": profiling_s,
        "search_s": {"median": search_s, "min": min(runs), "runs": runs},
        "search_phases_s": {**phases, "other": phases_total - sum(phases.values()), "total": phases_total},
        "target_s": TARGET_S,
        "meets_target": search_s < TARGET_S,
        "plan": None if choice is None else plan_summary(ctx, req, choice),
    }

    sp = result["space"]
    table = Table(
        title=f"OSDP search: {req.model_label} ({sp['params'] / 1e9:.2f}B params), "
        f"{req.world_size} x {args.preset}, limit {req.memory_limit_bytes / GIB:.1f} GiB, "
        f"seq {args.seq_len}, {args.precision} ({stdlib_platform.node()}, {os.cpu_count()} CPUs)"
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("units x options (max per unit)", f"{sp['units']} x {sp['options_per_unit_max']}")
    table.add_row("micro batches", ", ".join(map(str, sp["micro_batches"])))
    table.add_row("candidates scored", f"{sp['candidates_scored']:,}")
    table.add_row("profiling (fake tensors)", f"{profiling_s:.2f} s")
    table.add_row(f"search, median of {args.repeats}", f"{search_s:.3f} s (min {min(runs):.3f})")
    for name, s in result["search_phases_s"].items():
        if name != "total":
            table.add_row(f"  {name}", f"{s:.3f} s")
    table.add_row(f"target < {TARGET_S:.0f} s", "met" if result["meets_target"] else "MISSED")
    plan = result["plan"]
    if plan is None:
        table.add_row("plan", "none fits")
    else:
        table.add_row("micro batch x accumulation", f"{plan['micro_batch']} x {plan['grad_accum']}")
        table.add_row(
            "predicted peak (search bound)",
            f"{plan['peak_gib']:.2f} GiB ({plan['bound_gib']:.2f}) of {plan['limit_gib']:.1f}",
        )
        table.add_row("step time / throughput", f"{plan['step_time_s']:.3f} s / {plan['throughput']:.1f} samples/s")
        table.add_row("units by option", "; ".join(f"{k}: {v}" for k, v in plan["mix"].items()))
        if plan["vs_best_uniform"] is not None:
            table.add_row("vs best uniform plan", f"{plan['vs_best_uniform']:.3f}x")
    console.print(table)
    if args.profile:
        print(top_of_profile(ctx, req))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"written {args.out}")


if __name__ == "__main__":
    main()
