"""Host memory of one rank building a model that does not fit it whole (meta device, plan, shards, init).

One rank of `--world` runs in this process with a fake process group (real FSDP2 sharding, no
collectives) and builds the recipe's model exactly as a Ray Train worker does
(`osdp_platform.runtime.models.build_sharded`), on CPU. Reports the peak RSS the build added next to the
rank's shards, the largest unit (what meta_init holds in full at a time) and the whole fp32 model.
Writes benchmarks/results/meta_init_memory.json. Example (Llama-2-7B, rank 0 of 8, ~4 GiB, ~1 min):
  .venv/bin/python benchmarks/meta_init_memory.py recipes/llama.yaml planner.name=zero3 --world 8
"""

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from osdp_planners.torch_private import register_fake_backend
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.models import build_model, build_sharded

RESULTS = Path(__file__).resolve().parent / "results" / "meta_init_memory.json"
MIB = 1024**2


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, [*args.overrides, "hardware.nodes=1", f"hardware.workers_per_node={args.world}"])
    plan = plan_recipe(recipe).plan
    torch.set_num_threads(1)
    register_fake_backend()
    dist.init_process_group("fake", rank=args.rank, world_size=args.world, store=dist.HashStore())
    before = _peak_rss()
    start = time.perf_counter()
    torch.manual_seed(recipe.train.seed)
    model = build_sharded(recipe.model, plan, torch.device("cpu"))
    seconds = time.perf_counter() - start
    grown = _peak_rss() - before
    shards = sum(4 * p.to_local().numel() for p in model.parameters())
    full = 4 * sum(p.numel() for p in build_model(recipe.model, "meta").parameters())
    largest_unit = max(4 * u.param_count for u in plan.units)
    dist.destroy_process_group()
    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "model": plan.model,
        "planner": plan.planner,
        "world": args.world,
        "rank": args.rank,
        "build_s": round(seconds, 1),
        "peak_rss_grown_mib": round(grown / MIB),
        "shards_mib": round(shards / MIB),
        "largest_unit_mib": round(largest_unit / MIB),
        "full_model_mib": round(full / MIB),
    }
    print(json.dumps(result, indent=1))
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
