"""For a GPU machine: one rank of an N-rank job, its CUDA peaks against the planner's prediction.

Rank 0 of `--world` ranks runs with a fake process group: FSDP2 shards, gathers and frees exactly
as in the real job, on real CUDA tensors, while collectives move nothing. For each plan (uniform
DP, ZeRO-2, ZeRO-3, HSDP, OSDP's plan under `--osdp-budget-gb`, and a mixed plan: every other unit
DP, the rest ZeRO-3), each in a process of its own with the workers' allocator settings
(platform/osdp_platform/runtime/worker_env.py), it reports the allocator's allocated and reserved peaks over
steady-state steps beside the simulated peak, and how much of the GPU margin
(planners/osdp_planners/margin.py) the reserve-over-allocated gap uses. `--snapshot PLAN` records the
allocator's history for one plan and prints the blocks alive at its allocated peak, grouped by where
they were allocated. Imports no Ray or MLflow.
Prints a table and writes benchmarks/results/gpu_fake_rank.json. One call on a lent H100/H200, from the
repository's root (PYTHONPATH stands in for installing the platform, as for gpu_check.py):
  PYTHONPATH=platform:planners python benchmarks/gpu_fake_rank.py recipes/llama.yaml model.size=1b --world 8
`--device cpu` runs the same code with torch's memory tracker (no reserve), as a smoke test.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from osdp_planners import PlanResult
from osdp_planners.evaluate import Context, evaluate
from osdp_planners.options import Option
from osdp_planners.plan import Plan, Strategy
from osdp_planners.torch_private import register_fake_backend
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.apply import Meshes, apply_plan
from osdp_platform.runtime.memory import measure_step_peak
from osdp_platform.runtime.models import build_model
from osdp_platform.runtime.step import build_optimizer, train_step
from osdp_platform.runtime.worker_env import worker_env

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_fake_rank.json"
MIB = 1024**2


def _plans(recipe: Recipe, names: list[str], osdp_budget_gb: float) -> tuple[dict[str, Plan], Context]:
    """The plans named, and the context (profile, times) they were predicted in: planned once each.
    Uniform plans are planned without a budget (each is measured as it is); OSDP under `osdp_budget_gb`."""

    def planned(name: str) -> PlanResult:
        budget = osdp_budget_gb if name == "osdp" else 1e4
        return plan_recipe(
            recipe.model_copy(
                update={"planner": recipe.planner.model_copy(update={"name": name, "memory_limit_gb": budget})}
            )
        )

    results = {name: planned("zero3" if name == "mixed" else name) for name in names}
    plans = {name: r.plan for name, r in results.items()}
    if "mixed" in plans:
        zero3 = plans["mixed"]
        mixed = [
            u.model_copy(update={"strategy": Strategy.DDP, "shard_group_size": 1}) if i % 2 else u
            for i, u in enumerate(zero3.units)
        ]
        plans["mixed"] = zero3.model_copy(update={"units": mixed})
    return plans, next(iter(results.values())).context


def _blocks_at_peak(snapshot: dict[str, Any], top: int = 12) -> list[dict[str, Any]]:
    """Replay the allocator's trace to its allocated peak and group the live blocks by allocation site."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            frames = [
                f
                for f in event.get("frames", [])
                if f["filename"].endswith(".py") and "torch/utils" not in f["filename"]
            ]
            site = " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:3])
            live[addr] = (size, site)
            total += size
            if total > best:
                best, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, list[int]] = {}
    for size, site in at_peak.values():
        groups.setdefault(site, []).append(size)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    rows = [{"site": s, "blocks": len(v), "mib": sum(v) / MIB} for s, v in ranked]
    return [*rows, {"site": "peak", "mib": best / MIB}]


def _measure(
    recipe: Recipe, plan: Plan, device: torch.device, meshes: Meshes, steps: int, snapshot: bool
) -> dict[str, Any]:
    model: nn.Module = build_model(recipe.model, "meta")
    apply_plan(model, plan, device.type, meshes=meshes)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "init_weights"):
            module.init_weights()
    opt = build_optimizer(model, recipe.train)
    x = torch.randint(0, 256, (plan.micro_batch_size, plan.seq_len), device=device)
    batches = [(x, x)] * plan.grad_accum_steps
    train_step(model, opt, batches, plan.grad_accum_steps)  # optimizer states exist from here on
    allocated = reserved = 0
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=400_000)
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        allocated = max(
            allocated,
            measure_step_peak(model, opt, lambda: train_step(model, opt, batches, plan.grad_accum_steps), device),
        )
        if device.type == "cuda":
            reserved = max(reserved, torch.cuda.max_memory_reserved(device))
    out: dict[str, Any] = {"allocated_peak_bytes": allocated, "reserved_peak_bytes": reserved or allocated}
    if snapshot:
        out["at_peak"] = _blocks_at_peak(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    return out


def _measure_in_child(plan: Plan, argv: list[str]) -> dict[str, Any]:
    """One plan in a fresh process: no allocator state left by another plan, the workers' environment."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(plan.model_dump_json())
        f.flush()
        env = {**os.environ, **worker_env(os.environ)}
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--measure", f.name], env=env, capture_output=True, text=True, check=False
        )
    if done.returncode:
        raise RuntimeError(f"measuring plan failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the first")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plans", nargs="*", default=["ddp", "zero2", "zero3", "hsdp", "osdp", "mixed"])
    parser.add_argument("--osdp-budget-gb", type=float, default=24.0, help="the budget OSDP plans under")
    parser.add_argument("--snapshot", default="", help="a plan whose blocks at the allocated peak are listed (CUDA)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a child process: measure this plan file
    parser.add_argument("--name", help=argparse.SUPPRESS)  # the measured plan's name
    args = parser.parse_args()
    accel = "gpu" if args.device == "cuda" else "cpu"
    pool = ["hardware.nodes=1", f"hardware.workers_per_node={args.world}", f"hardware.accelerator={accel}"]
    recipe = load_recipe(args.recipe, [*args.overrides, *pool, *([] if accel == "gpu" else ["hardware.preset=cpu"])])
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.measure:  # a child process: one plan, its peaks as a JSON line
        plan = Plan.from_file(args.measure)
        register_fake_backend()
        dist.init_process_group("fake", rank=0, world_size=args.world, store=dist.HashStore())
        try:
            meshes = Meshes(device.type, args.world, {})
            snapshot = device.type == "cuda" and args.name == args.snapshot
            print(json.dumps(_measure(recipe, plan, device, meshes, args.steps, snapshot)))
        finally:
            dist.destroy_process_group()
        return
    plans, ctx = _plans(recipe, args.plans, args.osdp_budget_gb)
    margin = recipe.memory_margin
    rows: list[dict[str, Any]] = []
    for name, plan in plans.items():
        options = {u.name: Option.of(u) for u in plan.units}
        predicted = evaluate(ctx, options, plan.micro_batch_size, plan.grad_accum_steps).peak_bytes
        measured = _measure_in_child(plan, [*sys.argv[1:], "--name", name])
        budget = margin.budget_for(predicted)  # the smallest budget this plan is admitted under
        rows.append(
            {
                "plan": name,
                "strategies": sorted({u.strategy.value for u in plan.units}),
                "micro_batch": plan.micro_batch_size,
                "grad_accum": plan.grad_accum_steps,
                "predicted_peak_bytes": int(predicted),
                "predicted_reserved_bytes": int(margin.reserved(predicted)),
                "smallest_budget_bytes": int(budget),
                **measured,
                "allocated_within_prediction": measured["allocated_peak_bytes"] <= predicted,
                "reserved_within_budget": measured["reserved_peak_bytes"] <= budget,
                "allocated_vs_predicted": measured["allocated_peak_bytes"] / predicted - 1,
                "reserved_over_allocated": measured["reserved_peak_bytes"] / measured["allocated_peak_bytes"] - 1,
            }
        )
    print(
        f"{recipe.model.label}, rank 0 of {args.world}, {device.type}; margin {margin.describe()}; "
        "budget = the smallest this plan is admitted under"
    )
    print(
        f"{'plan':8} {'predicted MiB':>14} {'allocated MiB':>14} {'error':>8} {'pred. reserved':>15} "
        f"{'reserved MiB':>13} {'reserve +':>10} {'budget MiB':>11} {'ok':>4}"
    )
    for r in rows:
        print(
            f"{r['plan']:8} {r['predicted_peak_bytes'] / MIB:14.1f} {r['allocated_peak_bytes'] / MIB:14.1f} "
            f"{r['allocated_vs_predicted']:+8.2%} {r['predicted_reserved_bytes'] / MIB:15.1f} "
            f"{r['reserved_peak_bytes'] / MIB:13.1f} {r['reserved_over_allocated']:+10.2%} "
            f"{r['smallest_budget_bytes'] / MIB:11.1f} "
            f"{'yes' if r['allocated_within_prediction'] and r['reserved_within_budget'] else 'NO':>4}"
        )
        for block in r.get("at_peak", []):
            print(f"    {block['mib']:10.1f} MiB  {block.get('blocks', '')!s:>5}  {block['site']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(
                    ["benchmarks/gpu_fake_rank.py", args.recipe, *args.overrides, "--world", str(args.world)]
                ),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
