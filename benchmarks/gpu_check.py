"""One GPU check: predicted vs measured step time, and the platform's speed beside a hand-written loop.

For each case (llama 1b at world 1 and as rank 0 of 8, llama 7b as rank 0 of 8; ddp / zero3 / osdp
plans) a fresh process plans the recipe as `osdp-platform plan` does (the probe times the model on
this GPU where it fits), applies the plan with FSDP2 and times `train_step`. A fake rank runs under
the fake process group: collectives move nothing, compute and memory are real, so its plan is also
predicted with communication priced at zero. Per model a hand-written loop (the plain module,
torch.autocast(bf16), AdamW(fused=True)) gives the speed to match. MFU = (6N + 12 L d s) x tokens/s /
peak (osdp_planners.mfu). Needs torch, numpy, scipy, pyyaml, pydantic and omegaconf: nothing here
imports Ray or MLflow, so a node can be checked before the platform is installed on it: from the
repository's root, PYTHONPATH names its two package folders.
Writes benchmarks/results/gpu_check.json and its section of benchmarks/RESULTS.md.
Run (at most 5 minutes on one H100/H200):  PYTHONPATH=platform:planners python benchmarks/gpu_check.py
Smoke test on CPU:  PYTHONPATH=platform:planners python benchmarks/gpu_check.py --device cpu --tiny
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osdp_planners.compute_probe import sync
from osdp_planners.evaluate import Context, evaluate
from osdp_planners.hardware import LinkSpec, get_preset
from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.mfu import mfu, model_shape
from osdp_planners.options import Option
from osdp_planners.plan import Plan
from osdp_planners.time_model import optimizer_seconds, unit_time
from osdp_planners.torch_private import register_fake_backend
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.apply import Meshes
from osdp_platform.runtime.models import build_model, build_sharded
from osdp_platform.runtime.step import build_optimizer, train_step
from osdp_platform.runtime.worker_env import worker_env

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parent / "recipes" / "llama.yaml"
RESULTS = HERE / "results" / "gpu_check.json"
MARKERS = ("<!-- gpu_check -->", "<!-- /gpu_check -->")
WARMUP, STEPS = 3, 12  # one case measured 0.307 s and 0.269 s over 6 steps in two runs
CASE_TIMEOUT_S = 150  # one case that hangs must not eat the check's 5 minutes (twice that compiled)
TARGETS = (
    "step within 10% of predicted in every case; tokens/s >= 1.0x the hand-written loop at world 1, "
    ">= 1.1x with train.compile"
)
# name -> (model size, world, planner, micro batch, train.compile); world 1 runs a real process group of one
CASES = {
    "1b world 1 ddp": ("1b", 1, "ddp", 4, False),
    "1b world 1 ddp compiled": ("1b", 1, "ddp", 4, True),
    "1b rank 0 of 8 ddp": ("1b", 8, "ddp", 4, False),
    "1b rank 0 of 8 zero3": ("1b", 8, "zero3", 4, False),
    "1b rank 0 of 8 osdp": ("1b", 8, "osdp", 4, False),
    "7b rank 0 of 8 zero3": ("7b", 8, "zero3", 1, False),
    "7b rank 0 of 8 osdp": ("7b", 8, "osdp", 1, False),
    "7b rank 0 of 8 ddp": ("7b", 8, "ddp", 1, False),  # 16 bytes a parameter: fits an H200 only, if at all
}
TINY = ["model.size=tiny", "data.seq_len=64"]  # the CPU smoke test's shape


def _preset(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0)
    return "h200-141gb" if "H200" in name else "a100-80gb" if "A100" in name else "h100-80gb"


def _recipe(size: str, world: int, planner: str, micro: int, compile: bool, args: argparse.Namespace) -> Recipe:
    accel = "gpu" if args.device == "cuda" else "cpu"
    return load_recipe(
        RECIPE,
        [
            f"model.size={size}",
            f"data.seq_len={args.seq_len}",
            "train.precision=bf16-mixed",
            f"train.micro_batch_size={micro}",
            "train.global_batch_size=null",
            "hardware.nodes=1",
            f"hardware.workers_per_node={world}",
            f"hardware.accelerator={accel}",
            f"hardware.preset={_preset(args.device)}",
            f"planner.name={planner}",
            f"train.compile={str(compile).lower()}",
            *(TINY if args.tiny else []),
        ],
    )


def _free_cache(device: torch.device) -> None:
    """Hand the last model's blocks back, so that the next one starts from the same allocator state."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass(frozen=True)
class Timed:
    """Median seconds of a step, and of its host part (until its call returns, before the device is waited
    for): a host part close to the step means the step follows the host's speed, not the GPU's."""

    step_s: float
    host_s: float


def _median_step(step: Callable[[], object], device: torch.device) -> Timed:
    """Median seconds of a step after warm-up (the optimizer's states appear at the first)."""
    times, host = [], []
    for i in range(WARMUP + STEPS):
        sync(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            host.append(t1 - t0)
    return Timed(statistics.median(times), statistics.median(host))


def _free_links(ctx: Context) -> Context:
    """The same context with every collective free: what a fake rank's step should take."""
    free = LinkSpec(0.0, math.inf)
    device = dataclasses.replace(ctx.topo.device, intra_node=free, inter_node=free)
    return dataclasses.replace(ctx, topo=dataclasses.replace(ctx.topo, device=device, measured=None))


def _platform_step(recipe: Recipe, plan: Plan, device: torch.device) -> tuple[Timed, Timed, float]:
    """`train_step` on the plan applied with FSDP2, as a worker runs it, on one synthetic batch; then the
    optimizer's step alone, on the gradients of one more pass (to hold beside the time model's part); and
    the seconds the build took (initialisation included), which a worker spends before its first step."""
    started = time.perf_counter()
    model = build_sharded(recipe.model, plan, device, Meshes(device.type, plan.world_size, {}))
    sync(device)
    built = time.perf_counter() - started
    optimizer = build_optimizer(model, recipe.train)
    x = torch.randint(0, 256, (plan.micro_batch_size, plan.seq_len), device=device)
    batches = [(x, x)] * plan.grad_accum_steps
    step = _median_step(lambda: train_step(model, optimizer, batches, plan.grad_accum_steps), device)
    lm_loss(logits_of(model(x)), x).backward()  # train_step leaves no gradients behind
    return step, _median_step(optimizer.step, device), built


def _hand_step(recipe: Recipe, micro: int, seq_len: int, device: torch.device, compiled: bool = False) -> Timed:
    """What a user writes without the platform: the plain module, autocast to bf16, fused AdamW
    (`compiled`: each block through torch.compile, as torchtitan compiles)."""
    model = build_model(recipe.model, str(device))
    if compiled:
        for block in getattr(model, "layers", []):
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr, fused=device.type == "cuda")
    x = torch.randint(0, 256, (micro, seq_len), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(logits_of(model(x)), x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _median_step(step, device)


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plan, apply and time one case in this process (a fresh one per case: its own CUDA memory and group)."""
    started = time.perf_counter()
    size, world, planner, micro, compile = CASES[name]
    recipe = _recipe(size, world, planner, micro, compile, args)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = plan_recipe(recipe)
    planned = time.perf_counter() - started
    plan, ctx = result.plan, result.context
    options = {u.name: Option.of(u) for u in plan.units}
    free = evaluate(_free_links(ctx), options, plan.micro_batch_size, plan.grad_accum_steps).step_time_s
    if world == 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
    else:
        register_fake_backend()
        backend = "fake"
    dist.init_process_group(backend, rank=0, world_size=world, store=dist.HashStore())
    try:
        timed, optimizer, built = _platform_step(recipe, plan, device)
    finally:
        dist.destroy_process_group()
    tokens = plan.micro_batch_size * plan.grad_accum_steps * plan.seq_len
    measured = timed.step_s
    shape = model_shape(build_model(recipe.model, "meta"))
    peak = get_preset(recipe.hardware.preset).peak_flops_per_s
    step_parts = _step_parts(ctx, options, plan.micro_batch_size, plan.grad_accum_steps)
    row: dict[str, Any] = {
        "case": name,
        "model": recipe.model.label,
        "world": world,
        "planner": planner,
        "strategies": sorted({u.strategy.value for u in plan.units}),
        "micro_batch": plan.micro_batch_size,
        "seq_len": plan.seq_len,
        "timed_on_device": ctx.measured is not None,
        "timed_at_micro_batches": list(ctx.measured.batches) if ctx.measured else None,  # the lines run through them
        "probe_cpu_wait_share": ctx.measured.cpu_wait_share if ctx.measured else None,  # a busy host's probe is slow
        "predicted_step_s": plan.predicted.step_time_s,
        "predicted_no_comm_step_s": free,
        "measured_step_s": measured,
        "host_s": timed.host_s,
        "optimizer_s": optimizer.step_s,  # the optimizer's step alone (predicted: predicted_parts_s.optimizer)
        "optimizer_host_s": optimizer.host_s,
        "tokens_per_s": tokens / measured,
        "mfu": mfu(tokens / measured, shape.flops_per_token(plan.seq_len), peak),
        "peak_flops_per_s": peak,
        "predicted_parts_s": step_parts,
        "compile": compile,
    }
    if world == 1:
        _free_cache(device)
        hand = _hand_step(recipe, plan.micro_batch_size, plan.seq_len, device).step_s
        row |= {
            "hand_step_s": hand,
            "hand_tokens_per_s": tokens / hand,
            "hand_mfu": mfu(tokens / hand, shape.flops_per_token(plan.seq_len), peak),
        }
        if compile:  # the reference a compiled platform step is also held beside
            _free_cache(device)
            row["hand_compiled_step_s"] = _hand_step(recipe, plan.micro_batch_size, plan.seq_len, device, True).step_s
    row |= {"plan_s": planned, "build_s": built, "case_s": time.perf_counter() - started}  # where a case's time goes
    return row


def _step_parts(ctx: Context, options: dict[str, Option], batch: int, accum: int) -> dict[str, Any]:
    """The predicted step by part: compute (with FSDP2's copies), communication, optimizer; and the probe."""
    times = [
        unit_time(ctx.profile, u, o, batch, ctx.topo, ctx.measured, ctx.compute_bytes, ctx.overlap)
        for u, o in options.items()
    ]
    parts: dict[str, Any] = {
        "compute": accum * sum(t.compute_s for t in times),
        "comm": accum * sum(t.comm_s for t in times),
        "optimizer": optimizer_seconds(ctx.profile, options, ctx.topo, ctx.measured),
    }
    if ctx.measured is not None:
        m = ctx.measured
        parts["probe_forward"] = sum(line.at(batch) for line in m.forward.values())
        parts["probe_backward"] = sum(line.at(batch) for line in m.backward.values())
        parts["fsdp_s_per_byte"] = {s: m.fsdp_at(s, batch)[0] for s in m.fsdp_s_per_byte}  # at the micro batch
        parts["fsdp_s_per_unit"] = {s: m.fsdp_at(s, batch)[1] for s in m.fsdp_s_per_unit}
        parts["optimizer_tensor_cost_s"] = m.optimizer_tensor_cost_s
    return parts


def _error(row: dict[str, Any]) -> float:
    """Measured against the prediction a fake rank should meet: communication free where it moves nothing."""
    predicted = row["predicted_step_s"] if row["world"] == 1 else row["predicted_no_comm_step_s"]
    return row["measured_step_s"] / predicted - 1


def _timed_at(row: dict[str, Any]) -> str:
    """The micro batches the probe timed, or that it timed nothing (the preset's FLOP rate priced the case)."""
    return " and ".join(map(str, row.get("timed_at_micro_batches") or [])) or "not timed"


def markdown(rows: list[dict[str, Any]], command: str) -> list[str]:
    lines = [
        MARKERS[0],
        "## GPU check: predicted vs measured step, platform vs a hand-written loop",
        "",
        f"`{command}` on {rows[0].get('device', '?')}; bf16-mixed, seq {rows[0]['seq_len']}. A fake rank's "
        "collectives move nothing, so it is held to the prediction with communication priced at zero. "
        f"MFU = (6N + 12 L d s) x tokens/s / {rows[0]['peak_flops_per_s'] / 1e12:g} TFLOP/s. Targets: {TARGETS}.",
        "",
        "| case | plan | micro | timed on device at | predicted s | predicted, no comm s | measured s | error | "
        "host / step | optimizer s (predicted) | tokens/s | MFU | hand-written tokens/s | MFU | platform / hand |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |" + " |" * 13)
            continue
        hand = r.get("hand_tokens_per_s")
        ratio = f"{r['tokens_per_s'] / hand:.3f}x" if hand else "-"
        hand_cells = f"{hand:,.0f} | {r['hand_mfu']:.1%}" if hand else "- | -"
        lines.append(
            f"| {r['case']} | {'+'.join(r['strategies'])} | {r['micro_batch']} | {_timed_at(r)} | "
            f"{r['predicted_step_s']:.4f} | {r['predicted_no_comm_step_s']:.4f} | {r['measured_step_s']:.4f} | "
            f"{_error(r):+.1%} | {r['host_s'] / r['measured_step_s']:.0%} | "
            f"{r['optimizer_s']:.4f} ({r['predicted_parts_s']['optimizer']:.4f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['mfu']:.1%} | {hand_cells} | {ratio} |"
        )
    return [*lines, MARKERS[1]]


def write_section(md: Path, section: list[str]) -> None:
    """Replace this check's section of RESULTS.md (between its markers), or append it."""
    text = md.read_text() if md.exists() else "# Benchmark results\n"
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    block = "\n".join(section)
    if start >= 0 and end > start:
        text = text[:start] + block + text[end + len(MARKERS[1]) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(text)


def _failure(stderr: str) -> str:
    """A failed case's last lines: an exception's message and, for a UserError, the fix line after it (the
    last line alone once kept the fix and lost what failed, on a device run that cannot be repeated soon)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return " / ".join(lines[-4:])[-800:] or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny llama at seq 64 (a smoke test)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process: run this one case, print its row
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return
    command = " ".join(["python benchmarks/gpu_check.py", *sys.argv[1:]])
    started = time.perf_counter()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    rows: list[dict[str, Any]] = []
    for name in args.cases:
        child = [sys.executable, __file__, "--case", name, "--device", args.device, "--seq-len", str(args.seq_len)]
        env = {**os.environ, **worker_env(os.environ)}  # the allocator settings the workers run with
        try:
            done = subprocess.run(
                [*child, *(["--tiny"] if args.tiny else [])],
                capture_output=True,
                text=True,
                env=env,
                timeout=CASE_TIMEOUT_S * (2 if CASES[name][4] else 1),
            )
        except subprocess.TimeoutExpired:
            rows.append({"case": name, "error": "over its time limit"})
        else:
            if done.returncode:
                rows.append({"case": name, "error": _failure(done.stderr)})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        rows[-1]["device"] = device
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after every case: a check cut short keeps its rows
        args.out.write_text(
            json.dumps({"command": command, "device": device, "targets": TARGETS, "rows": rows}, indent=2)
        )
    ok = [r for r in rows if "error" not in r]
    if ok and not args.tiny:
        write_section(HERE / "RESULTS.md", markdown(ok, command))
    for line in markdown(ok, command) if ok else []:
        print(line)
    print(f"gpu_check: {len(ok)} of {len(rows)} cases in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
