"""The OSDP paper's setups, predicted: our OSDP plan against the best uniform plan and against FSDP as the
paper's research code wrapped it, beside the published ratio.

Plans only (meta device, no Ray, no accelerator). The paper's FSDP baseline wrapped every operator of at
least 1M parameters (fairscale auto_wrap, opt/train_opt_fsdp.py), finer than our uniform ZeRO-3, whose
units are blocks; the nearest plan in our space is ZeRO-3 with every unit's Linears split k ways, so the
`fsdp_like` column is the best such plan over k (evaluated by the same cost model). Writes
benchmarks/results/paper_setups.json; benchmarks/results_md.py renders it into RESULTS.md.
Run: .venv/bin/python benchmarks/paper_setups.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from osdp_planners.evaluate import Context, evaluate
from osdp_planners.options import SPLITS, Option
from osdp_planners.plan import Plan, Strategy
from osdp_planners.request import PlanRequest
from osdp_planners.space import batch_candidates
from osdp_platform.planning.local import plan_recipe, plan_request
from osdp_platform.recipe.loader import load_recipe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "paper_setups.json"
# label -> recipe, overrides, the published OSDP / FSDP throughput ratio (None: the paper has no such run)
SETUPS: dict[str, tuple[str, list[str], float | None]] = {
    "GPT-2 48 layers / hidden 1536, 8 x 8 GB, as the paper ran it (seq 6, 96 per GPU, fp32)": (
        "paper-gpt2-48l.yaml",
        [],
        192.26 / 158.05,
    ),
    "OPT-30B width, 8 layers, 8 x 16 GB, as the paper ran it (seq 128 assumed, 2 per GPU, fp32)": (
        "paper-opt-30b-8l.yaml",
        [],
        1261.98 / 453.18,
    ),
    "GPT-2 48 layers / hidden 1536, 8 x 8 GB, seq 1024 fp32 batch chosen (recipes/gpt2.yaml)": ("gpt2.yaml", [], None),
    "OPT-30B width, 8 layers, 8 x 16 GB, seq 1024 bf16 batch chosen (recipes/opt.yaml)": ("opt.yaml", [], None),
    "Llama-2-7B, 8 x A100-80GB": ("llama.yaml", [], None),
    "Llama-2-70B, 64 x H100-80GB": ("llama-70b.yaml", ["hardware.preset=h100-80gb"], None),
}

# why our prediction and the published ratio differ, per recipe (read off the numbers this script writes)
EXPLAIN = {
    "paper-gpt2-48l.yaml": (
        "predicted 1.00x until the time model charged ZeRO-3's second all-gather (it moved one gather's bytes "
        "for two; fixed with this run). The step is communication-bound: 6-token sequences give 0.09 s of "
        "compute against 1.43 s of ZeRO-3 traffic in fp32 over PCIe (10 GB/s), and ZeRO-2, which keeps the "
        "gathered parameters until backward instead of gathering again, moves two thirds of it. OSDP makes "
        "every unit ZeRO-2 (59 of 97 checkpointed to fit 7.99 GiB; the paper's OSDP measured 8057 MB) and is "
        "predicted 1.49x over ZeRO-3, which is the paper's FSDP here (each Linear its own fairscale unit; ours "
        "4.63 GiB, the paper measured 5657 MB): memory agrees, the gain does not. The paper measured 1.22x "
        "because it trained in fp32, which our preset prices at the TITAN's bf16 tensor rate (130 TFLOP/s peak, "
        "fp32: 16.3) with all communication hidden behind compute: at the fp32 rate with no overlap the same "
        "two plans take 2.16 and 1.85 s per step (1.16x; the recomputation now costs), and the published ratio "
        "lies between the two bounds. Presets have no fp32 rate yet"
    ),
    "paper-opt-30b-8l.yaml": (
        "the published 2.78x compares unequal batches: the research code's FSDP script trains 1 sequence per GPU "
        "(opt/scripts/train_fsdp.sh, --train_batch_size 1), its OSDP script 2 (train_osdp.sh). Its FSDP wrapped "
        "every operator of 1M+ parameters, so it gathers one Linear at a time; our uniform ZeRO-3, one unit per "
        "block, needs 16.86 GiB and does not fit, and the nearest plan of ours, ZeRO-3 with Linears split 2, "
        "fits at 15.19 GiB (the paper measured 14803 MB). That plan is predicted 1.42 samples/s at 1 per GPU "
        "and 2.84 at 2, so the fastest plan OSDP finds (about 3.16 at 2 per GPU; the near-tie rule may return "
        "a simpler one within 10%) is 2.2x over it as the paper ran it and 1.1x at equal batch: the batch "
        "accounts for 2.0x of the published ratio. The rest, as for GPT-2: fp32 compute priced at the bf16 "
        "rate with full overlap, and the sequence length of its data (128 is our assumption). The gap proved "
        "here is about 1%: HiGHS stops at auto's 5 s limit on this wide 8-layer program before closing it"
    ),
    "gpt2.yaml": (
        "not the paper's setup: at 1,024-token sequences in fp32, no uniform plan fits 8 GiB after the 5% + "
        "1 GiB margin, and OSDP fits only by checkpointing; the paper's own run is the first row"
    ),
    "opt.yaml": (
        "not the paper's setup (seq 1024, bf16, the batch left to the planner): uniform ZeRO-3 fits only 1 "
        "sequence per GPU, the operator-wrapped FSDP-like plan 2, while OSDP's mix fits 8, which is most of "
        "its 4.46x and 2.23x"
    ),
    "llama.yaml": (
        "uniform ZeRO-2 at micro batch 2 is the fastest plan found, and ZeRO-3 there is 0.07% slower: at this "
        "size every unit fits under ZeRO-2, so a mix has nothing to gain. ZeRO-3 at micro batch 4 (64 GiB "
        "allocated) was the fastest before plans had to leave the caching allocator its 25%. Attention's "
        "scores and values are 8% of the step's FLOPs at 2,048 tokens: 12.07 samples/s before they were counted"
    ),
}


def fsdp_like(ctx: Context, req: PlanRequest) -> dict[str, Any] | None:
    """The fastest fitting uniform ZeRO-3 plan with every splittable unit's Linears split k ways."""
    best: dict[str, Any] | None = None
    for k in SPLITS:
        opts = {
            u.name: Option(Strategy.ZERO3, req.world_size, k if ctx.profile.linear_bytes[u.name] else 1)
            for u in ctx.profile.units
        }
        for batch, accum in batch_candidates(req):
            ev = evaluate(ctx, opts, batch, accum)
            if ev.peak_bytes <= ctx.usable_memory_bytes and (best is None or ev.throughput > best["throughput"]):
                peak = ev.peak_bytes / 2**30
                best = {"split": k, "micro_batch": batch, "throughput": ev.throughput, "peak_gib": peak}
    return best


def row(label: str, name: str, overrides: list[str], published: float | None) -> dict[str, Any]:
    recipe = load_recipe(ROOT / "recipes" / name, ["planner.name=osdp", *overrides])
    result = plan_recipe(recipe)
    plan: Plan = result.plan
    fits = {k: b for k, b in plan.baselines.items() if b.fits and b.throughput_samples_per_s}
    best = max(fits, key=lambda k: fits[k].throughput_samples_per_s or 0) if fits else None
    search = plan.search
    return {
        "setup": label,
        "command": f"osdp-platform plan recipes/{name} {' '.join(overrides)}".strip(),
        "osdp_throughput": plan.predicted.throughput_samples_per_s,
        "osdp_peak_gib": (plan.predicted.peak_memory_bytes or 0) / 2**30,
        "osdp_mix": sorted({f"{u.strategy.value}({u.shard_group_size})x{u.split}" for u in plan.units}),
        "micro_batch": plan.micro_batch_size,
        "fastest_found": None if search is None else search.best.throughput_samples_per_s,
        "optimality_gap": None if search is None else search.optimality_gap,
        "search_s": None if search is None else search.seconds,
        "best_uniform": best,
        "best_uniform_throughput": fits[best].throughput_samples_per_s if best else None,
        "baselines": {k: b.model_dump() for k, b in plan.baselines.items()},
        "fsdp_like": fsdp_like(result.context, plan_request(recipe)),
        "published_ratio": published,
        "explanation": EXPLAIN.get(name),
    }


def main() -> None:
    rows = [row(label, *spec) for label, spec in SETUPS.items()]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        fsdp = r["fsdp_like"]
        ratio = f"{r['osdp_throughput'] / fsdp['throughput']:.2f}x (split {fsdp['split']})" if fsdp else "none fits"
        pub = f"{r['published_ratio']:.2f}x" if r["published_ratio"] else "-"
        print(f"{r['setup']}: OSDP {r['osdp_throughput']:.2f} samples/s, vs FSDP-like {ratio}, published {pub}")
    print(f"written {RESULTS}")


if __name__ == "__main__":
    main()
