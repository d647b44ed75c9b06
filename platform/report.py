"""Plans that explain themselves: a per-unit table, the comparison with uniform plans, a memory plot."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from osdp_planners import PlanResult
from osdp_planners.evaluate import evaluate
from osdp_planners.options import Option

MIB = 1024**2


def _fmt_bytes(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MIB:.1f} MiB"


def unit_table(result: PlanResult) -> Table:
    plan = result.plan
    table = Table(title=f"{plan.model}: plan by {plan.planner} for {plan.world_size} worker(s), "
                        f"micro batch {plan.micro_batch_size} x {plan.grad_accum_steps} accumulation")
    for col in ("unit", "params", "strategy", "split", "checkpoint", "resident memory", "time/step"):
        table.add_column(col, justify="left" if col in ("unit", "strategy") else "right", no_wrap=True)
    for u in plan.units:
        strategy = f"{u.strategy.value}({u.shard_group_size})" if u.strategy.value == "hsdp" else u.strategy.value
        table.add_row(u.name, f"{u.param_count / 1e6:.2f}M", strategy, str(u.split), "yes" if u.checkpoint else "",
                      _fmt_bytes(u.predicted_memory_bytes or 0), f"{(u.predicted_time_s or 0) * 1e3:.2f} ms")
    return table


def comparison(result: PlanResult) -> str:
    """One line: this plan against the best uniform plan that fits."""
    plan = result.plan
    pred = plan.predicted
    margin = plan.memory_margin
    usable = (f" ({_fmt_bytes(margin.usable_bytes)} usable after a {margin.fraction:.0%} + "
              f"{_fmt_bytes(margin.reserve_bytes)} margin)" if margin else "")
    head = (f"predicted: peak {_fmt_bytes(pred.peak_memory_bytes or 0)} of {_fmt_bytes(plan.memory_limit_bytes or 0)}"
            f"{usable}, step {pred.step_time_s or 0:.4f} s, {pred.throughput_samples_per_s or 0:.2f} samples/s")
    fitting = {k: b for k, b in plan.baselines.items() if b.fits and b.throughput_samples_per_s}
    if not fitting:
        return f"{head}; no uniform plan fits"
    name, best = max(fitting.items(), key=lambda kv: kv[1].throughput_samples_per_s or 0)
    ratio = (pred.throughput_samples_per_s or 0) / (best.throughput_samples_per_s or 1)
    return f"{head}; {plan.planner} {ratio:.2f}x the best uniform plan that fits ({name})"


def plot(result: PlanResult, path: Path) -> Path:
    """Predicted per-rank memory at each event of a step, with the limit and each unit's choice."""
    plan, ctx = result.plan, result.context
    options = {u.name: Option.of(u) for u in plan.units}
    timeline = evaluate(ctx, options, plan.micro_batch_size, plan.grad_accum_steps).timeline
    values = [v / MIB for _, v in timeline.events]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [3, 2]})
    ax.plot(values, marker=".", linewidth=1)
    if plan.memory_limit_bytes:
        ax.axhline(plan.memory_limit_bytes / MIB, color="red", linestyle="--", label="memory limit")
    ax.set_ylabel("MiB per rank")
    ax.set_xlabel("event of one training step (forward, loss, backward, optimizer)")
    ax.set_title(f"{plan.model}: predicted memory timeline (peak {max(values):.1f} MiB)")
    ax.legend()
    names = [u.name for u in plan.units]
    kinds = sorted({f"{u.strategy.value}/{u.shard_group_size}" for u in plan.units})
    colors = {k: plt.cm.tab10(i) for i, k in enumerate(kinds)}
    bars = bx.bar(range(len(names)), [(u.predicted_memory_bytes or 0) / MIB for u in plan.units],
                  color=[colors[f"{u.strategy.value}/{u.shard_group_size}"] for u in plan.units],
                  hatch=None)
    for bar, u in zip(bars, plan.units, strict=True):
        if u.checkpoint or u.split > 1:
            bar.set_hatch("//" if u.checkpoint else "..")
    bx.set_ylabel("resident MiB")
    bx.set_title("per-unit choice (colour: strategy/group; // checkpointed; .. split)")
    bx.set_xticks(range(len(names)), names if len(names) <= 24 else [""] * len(names), rotation=70, fontsize=7)
    bx.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              fontsize=7, ncol=min(len(colors), 6))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_report(result: PlanResult, console: Console, png: Path | None) -> None:
    console.print(unit_table(result))
    console.print(comparison(result), markup=False)
    if png is not None:
        console.print(f"memory timeline written to {plot(result, png)}", markup=False)
