"""For a GPU machine: CUDA peak memory and step time of one rank of an N-rank job vs the plan's prediction.

Rank 0 of `--world` ranks runs in this process with a fake process group: FSDP2 shards, gathers and
frees exactly as in the real job, on real CUDA tensors, while collectives move nothing (so step
time excludes communication; compare it with the predicted compute). Writes
benchmarks/results/gpu_fake_rank.json. Example (one H200):
  .venv/bin/python benchmarks/gpu_fake_rank.py recipes/llama.yaml model.kwargs.n_layers=8 --world 8
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from osdp_planners.options import Option
from osdp_planners.time_model import unit_time
from osdp_platform.apply import apply_plan
from osdp_platform.models import build_model
from osdp_platform.planning import plan_recipe
from osdp_platform.recipe_loader import load_recipe
from osdp_platform.step import build_optimizer, train_step

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_fake_rank.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, [*args.overrides, "hardware.nodes=1", f"hardware.workers_per_node={args.world}"])
    result = plan_recipe(recipe)
    plan, ctx = result.plan, result.context
    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=FakeStore())
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = build_model(recipe.model, "meta")
    apply_plan(model, plan, "cuda")
    model.to_empty(device="cuda")
    for module in model.modules():
        if hasattr(module, "init_weights"):
            module.init_weights()
    opt = build_optimizer(model, recipe.train)
    x = torch.randint(0, 256, (plan.micro_batch_size, plan.seq_len), device="cuda")
    times, peaks = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(model, opt, [(x, x)] * plan.grad_accum_steps, plan.grad_accum_steps)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated())
    compute = sum(unit_time(ctx.profile, u.name, Option.of(u), plan.micro_batch_size, ctx.topo, ctx.measured,
                            ctx.compute_bytes, overlap=False).compute_s for u in plan.units) * plan.grad_accum_steps
    row = {
        "recipe": args.recipe, "overrides": args.overrides, "world": plan.world_size,
        "micro_batch": plan.micro_batch_size, "accum": plan.grad_accum_steps,
        "measured_peak_bytes": max(peaks[1:]), "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
        "measured_step_s": sorted(times[1:])[len(times[1:]) // 2], "predicted_compute_s": compute,
        "predicted_step_s": plan.predicted.step_time_s, "reserved_bytes": torch.cuda.max_memory_reserved(),
    }
    row["memory_ratio"] = row["measured_peak_bytes"] / row["predicted_peak_bytes"]
    row["compute_ratio"] = row["measured_step_s"] / compute
    print(json.dumps(row, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(row, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
