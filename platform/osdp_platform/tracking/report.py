"""Plans that explain themselves: per-unit tables, the comparison with uniform plans, and charts.

The charts a run carries in MLflow: one rank's predicted memory at each event of a step beside the
measured peaks, each unit's choice, and the predicted step time split into compute, exposed
communication and the optimizer beside the measured step. `plan --png` draws the first two in one figure.
"""

import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from rich.console import Console
from rich.table import Table

from osdp_planners.cpu_wait import BUSY_TIMES
from osdp_planners.explanation import PlanResult
from osdp_planners.plan import EXTRAPOLATED, Plan, UnitPlan
from osdp_platform.tracking.runs import RunTracker

MIB = 1024**2


def _fmt_bytes(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MIB:.1f} MiB"


def _strategy(u: UnitPlan) -> str:
    return f"{u.strategy.value}({u.shard_group_size})" if u.strategy.value == "hsdp" else u.strategy.value


def unit_table(result: PlanResult) -> Table:
    plan = result.plan
    table = Table(
        title=f"{plan.model}: plan by {plan.planner} for {plan.world_size} worker(s), "
        f"micro batch {plan.micro_batch_size} x {plan.grad_accum_steps} accumulation"
    )
    for col in ("unit", "params", "strategy", "split", "checkpoint", "resident memory", "time/step"):
        table.add_column(col, justify="left" if col in ("unit", "strategy") else "right", no_wrap=True)
    for u in plan.units:
        table.add_row(
            u.name,
            f"{u.param_count / 1e6:.2f}M",
            _strategy(u),
            str(u.split),
            "yes" if u.checkpoint else "",
            _fmt_bytes(u.predicted_memory_bytes or 0),
            f"{(u.predicted_time_s or 0) * 1e3:.2f} ms",
        )
    return table


def unit_markdown(plan: Plan) -> str:
    """The per-unit plan as a Markdown table (MLflow shows it as text beside the charts)."""
    lines = [
        f"# {plan.model}: plan by {plan.planner}, {plan.world_size} worker(s), micro batch "
        f"{plan.micro_batch_size} x {plan.grad_accum_steps} accumulation",
        "",
        "| unit | params | strategy | split | checkpoint | predicted resident memory | predicted time/step |",
        "|---|---:|---|---:|:---:|---:|---:|",
    ]
    for u in plan.units:
        lines.append(
            f"| {u.name} | {u.param_count:,} | {_strategy(u)} | {u.split} | {'yes' if u.checkpoint else ''} "
            f"| {_fmt_bytes(u.predicted_memory_bytes or 0)} | {(u.predicted_time_s or 0) * 1e3:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def comparison(result: PlanResult) -> str:
    """One line: this plan against the best uniform plan that fits."""
    plan = result.plan
    pred = plan.predicted
    margin = plan.memory_margin
    allocator = f" and the allocator's {margin.allocator_overhead:.0%}" if margin and margin.allocator_overhead else ""
    usable = (
        f" ({_fmt_bytes(margin.usable(plan.memory_limit_bytes))} usable after a {margin.fraction:.0%} + "
        f"{_fmt_bytes(margin.reserve_bytes)} margin{allocator})"
        if margin and plan.memory_limit_bytes
        else ""
    )
    reserved = (
        f", reserved {_fmt_bytes(pred.reserved_memory_bytes)}"
        if pred.reserved_memory_bytes and pred.reserved_memory_bytes != pred.peak_memory_bytes
        else ""
    )
    head = (
        f"predicted: peak {_fmt_bytes(pred.peak_memory_bytes or 0)}{reserved} of "
        f"{_fmt_bytes(plan.memory_limit_bytes or 0)}{usable}, step {pred.step_time_s or 0:.4f} s, "
        f"{pred.throughput_samples_per_s or 0:.2f} samples/s"
    )
    if pred.times_from and pred.times_from.startswith("preset"):
        head += f" (times from the {pred.times_from}, not measured)"
    elif pred.times_from and pred.times_from != "measured":
        head += f" (times {pred.times_from})"
    fitting = {k: b for k, b in plan.baselines.items() if b.fits and b.throughput_samples_per_s}
    if not fitting:
        return f"{head}; no uniform plan fits"
    name, best = max(fitting.items(), key=lambda kv: kv[1].throughput_samples_per_s or 0)
    ratio = (pred.throughput_samples_per_s or 0) / (best.throughput_samples_per_s or 1)
    return f"{head}; {plan.planner} {ratio:.2f}x the best uniform plan that fits ({name})"


def slow_times(plan: Plan) -> str | None:
    """What a run's user is warned of before training: predictions from a probe that shared its host,
    or extrapolated far beyond the micro batches it timed."""
    said = plan.predicted.times_from
    return f"the plan's times were {said}" if said and (said.startswith(BUSY_TIMES) or EXTRAPOLATED in said) else None


def search_summary(plan: Plan) -> str | None:
    """What the search proved (its optimality gap) and, where the near-tie rule chose a simpler plan,
    what that cost against the fastest plan found."""
    r = plan.search
    if r is None:
        return None
    proved = (
        f"the best plan found is proven within {r.optimality_gap:.2%} of the optimum "
        f"(no plan exceeds {r.throughput_upper_bound:.2f} samples/s)"
        if r.optimality_gap is not None and r.throughput_upper_bound is not None
        else "no optimality bound (the knapsack proves none; planner.search=auto does)"
    )
    line = f"search {r.mode} in {r.seconds:.2f} s: {proved}"
    if r.simplicity_cost > 0:
        best = r.best.throughput_samples_per_s or 0
        line += (
            f"; chosen by {r.chosen_by}, {r.simplicity_cost:.2%} slower than the best found "
            f"({best:.2f} samples/s: {r.best_plan})"
        )
    return line


def _draw_memory(ax: Axes, result: PlanResult, measured_peaks: list[float]) -> None:
    plan = result.plan
    values = [v / MIB for _, v in result.explanation.timeline]
    ax.plot(values, marker=".", linewidth=1, label=f"predicted (peak {max(values):.1f} MiB)")
    for rank, peak in enumerate(measured_peaks):
        ax.axhline(
            peak / MIB,
            color=plt.cm.Dark2(rank % 8),
            linestyle=":",
            label=f"measured peak, rank {rank} ({peak / MIB:.1f} MiB)",
        )
    if plan.memory_limit_bytes:
        ax.axhline(plan.memory_limit_bytes / MIB, color="red", linestyle="--", label="memory limit")
    ax.set_ylabel("MiB per rank")
    ax.set_xlabel("event of one training step (forward, loss, backward, optimizer)")
    ax.set_title(f"{plan.model}, plan by {plan.planner}: memory over one step")
    ax.legend(fontsize=7)


def _draw_units(ax: Axes, plan: Plan) -> None:
    names = [u.name for u in plan.units]
    kinds = sorted({f"{u.strategy.value}/{u.shard_group_size}" for u in plan.units})
    colors = {k: plt.cm.tab10(i) for i, k in enumerate(kinds)}
    bars = ax.bar(
        range(len(names)),
        [(u.predicted_memory_bytes or 0) / MIB for u in plan.units],
        color=[colors[f"{u.strategy.value}/{u.shard_group_size}"] for u in plan.units],
    )
    for bar, u in zip(bars, plan.units, strict=True):
        if u.checkpoint or u.split > 1:
            bar.set_hatch("//" if u.checkpoint else "..")
    ax.set_ylabel("resident MiB")
    ax.set_title("per-unit choice (colour: strategy/group; // checkpointed; .. split)")
    ax.set_xticks(range(len(names)), names if len(names) <= 24 else [""] * len(names), rotation=70, fontsize=7)
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
        labels=list(colors),
        fontsize=7,
        ncol=min(len(colors), 6),
    )


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(result: PlanResult, path: Path) -> Path:
    """Predicted per-rank memory at each event of a step, with the limit and each unit's choice."""
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [3, 2]})
    _draw_memory(ax, result, [])
    _draw_units(bx, result.plan)
    return _save(fig, path)


def memory_chart(result: PlanResult, path: Path, measured_peaks: list[float]) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _draw_memory(ax, result, measured_peaks)
    return _save(fig, path)


def strategy_chart(plan: Plan, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4))
    _draw_units(ax, plan)
    return _save(fig, path)


def step_time_chart(result: PlanResult, path: Path, measured_step_s: float | None) -> Path:
    parts = result.explanation
    names = list(parts.units)
    units = list(parts.units.values())
    columns = {
        "compute": [u.compute_s for u in units],
        "exposed communication": [u.communication_s for u in units],
        "optimizer": [u.optimizer_s for u in units],
    }
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [4, 1]})
    bottom = [0.0] * len(names)
    totals = [0.0, 0.0, 0.0]
    for i, (label, seconds) in enumerate(columns.items()):
        values = [s * 1e3 for s in seconds]
        ax.bar(range(len(names)), values, bottom=bottom, label=label, color=plt.cm.tab10(i))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        totals[i] = sum(values)
    ax.set_xticks(range(len(names)), names if len(names) <= 24 else [""] * len(names), rotation=70, fontsize=7)
    ax.set_ylabel("predicted ms per step")
    ax.set_title(f"{result.plan.model}, plan by {result.plan.planner}: predicted step time per unit")
    ax.legend(fontsize=7)
    below = 0.0
    for i, (label, value) in enumerate(
        (
            ("compute", totals[0]),
            ("exposed communication", totals[1]),
            ("optimizer", totals[2]),
            ("per-step fixed", parts.fixed_s * 1e3),
        )
    ):
        bx.bar(0, value, bottom=below, color=plt.cm.tab10(i), label=label)
        below += value
    if measured_step_s is not None:
        bx.bar(1, measured_step_s * 1e3, color="grey")
    bx.set_xticks([0, 1], ["predicted", "measured\n(median)"])
    bx.set_ylabel("ms per step")
    bx.set_title("whole step")
    return _save(fig, path)


def log_report(
    tracker: RunTracker,
    result: PlanResult,
    measured_peaks: list[float] | None = None,
    measured_step_s: float | None = None,
) -> None:
    """The plan's table and charts as artifacts of `tracker`'s run, with what was measured where known."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tracker.log_text(unit_markdown(result.plan), "plan_units.md")
        for path in (
            memory_chart(result, folder / "memory.png", measured_peaks or []),
            strategy_chart(result.plan, folder / "strategies.png"),
            step_time_chart(result, folder / "step_time.png", measured_step_s),
        ):
            tracker.log_file(path)


def print_report(result: PlanResult, console: Console, png: Path | None) -> None:
    console.print(unit_table(result))
    console.print(comparison(result), markup=False)
    summary = search_summary(result.plan)
    if summary is not None:
        console.print(summary, markup=False)
    if png is not None:
        console.print(f"memory timeline written to {plot(result, png)}", markup=False)
