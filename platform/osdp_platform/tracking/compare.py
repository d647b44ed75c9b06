"""`compare`: runs side by side, as a table, JSON or Markdown, and as a chart on a comparison run.

The questions it answers: how much faster is a plan than what I use today, and can I trust the
planner's numbers. So a row holds the predicted and measured throughput and peak memory, the
fidelity errors (measured / predicted - 1), and the predicted speedup over the best uniform plan
that fits. Every number is read back from MLflow (tracking/records.py), so the table is what MLflow holds.
"""

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from osdp_planners.errors import UserError
from osdp_platform.tracking.keys import Metric, Tag
from osdp_platform.tracking.records import RunRecord, run_records
from osdp_platform.tracking.runs import RunTracker

Format = Literal["table", "json", "markdown"]
MIB = 1024**2
WIDE_CONSOLE = 100_000  # columns: wide enough for any table
COLUMNS = (
    "run",
    "planner",
    "status",
    "batch (micro x accum x workers)",
    "predicted samples/s",
    "measured samples/s",
    "predicted vs best uniform",
    "predicted peak MiB",
    "measured peak MiB",
    "step time error",
    "peak memory error",
)


@dataclass(frozen=True)
class Row:
    run_id: str
    name: str
    planner: str
    status: str
    batch: tuple[int, int, int] | None
    predicted_throughput: float | None  # samples/s
    measured_throughput: float | None
    best_uniform: str | None  # the fastest uniform plan that fits, by prediction
    best_uniform_throughput: float | None
    predicted_peak_bytes: float | None
    measured_peak_bytes: float | None
    step_time_error: float | None  # measured / predicted - 1
    peak_memory_error: float | None
    note: str

    @property
    def speedup(self) -> float | None:
        """Predicted throughput over the best uniform plan's."""
        if self.predicted_throughput is None or not self.best_uniform_throughput:
            return None
        return self.predicted_throughput / self.best_uniform_throughput


def row_of(record: RunRecord) -> Row:
    m = record.metrics
    baselines = record.baseline_throughputs()
    best = max(baselines, key=lambda k: baselines[k]) if baselines else None

    def error(ratio: str) -> float | None:
        return m[ratio] - 1.0 if ratio in m else None

    return Row(
        record.run_id,
        record.name,
        record.planner,
        record.status,
        record.batch,
        m.get(Metric.PREDICTED_THROUGHPUT),
        m.get(Metric.MEASURED_THROUGHPUT),
        best,
        baselines[best] if best else None,
        m.get(Metric.PREDICTED_PEAK_MEMORY),
        m.get(Metric.MEASURED_PEAK_MEMORY),
        error(Metric.STEP_TIME_RATIO),
        error(Metric.PEAK_MEMORY_RATIO),
        record.note,
    )


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def cells(row: Row, full_ids: bool = False) -> list[str]:
    """One row as printed; the formats are fixed so a reader (or a test) can check them against MLflow."""
    return [
        f"{row.name} ({row.run_id if full_ids else row.run_id[:8]})",
        row.planner,
        row.status,
        " x ".join(map(str, row.batch)) if row.batch else "-",
        _num(row.predicted_throughput, ".2f"),
        _num(row.measured_throughput, ".2f"),
        f"{row.speedup:.2f}x {row.best_uniform}" if row.speedup is not None else "-",
        _mib(row.predicted_peak_bytes),
        _mib(row.measured_peak_bytes),
        _num(row.step_time_error, "+.1%"),
        _num(row.peak_memory_error, "+.1%"),
    ]


def as_table(rows: list[Row], wide: bool = False) -> Table:
    """Narrow: cells wrap to fit the terminal, nothing is cut. Wide: one line a run, full run ids."""
    table = Table(title="runs compared (errors: measured / predicted - 1)")
    for col in COLUMNS:
        table.add_column(
            col,
            justify="left" if col in ("run", "planner", "status") else "right",
            no_wrap=wide,
            overflow="ignore" if wide else "fold",
        )
    for row in rows:
        table.add_row(*cells(row, full_ids=wide))
    return table


def as_markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def as_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) | {"speedup_vs_best_uniform": r.speedup} for r in rows], indent=1)


def chart(rows: list[Row], path: Path) -> Path:
    """Predicted against measured throughput and peak memory, one group of bars per run."""
    labels = [f"{r.name} {r.run_id[:6]}\n{r.planner}\n{r.status}" for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    x = range(len(rows))
    for axis, (pred, meas, unit, scale) in (
        (ax, ("predicted_throughput", "measured_throughput", "samples/s", 1)),
        (bx, ("predicted_peak_bytes", "measured_peak_bytes", "MiB", MIB)),
    ):
        axis.bar([i - 0.2 for i in x], [(getattr(r, pred) or 0) / scale for r in rows], 0.4, label="predicted")
        axis.bar([i + 0.2 for i in x], [(getattr(r, meas) or 0) / scale for r in rows], 0.4, label="measured")
        axis.set_xticks(list(x), labels, fontsize=7)
        axis.set_ylabel(unit)
        axis.legend(fontsize=7)
    for i, r in enumerate(rows):
        if r.best_uniform_throughput:
            ax.hlines(r.best_uniform_throughput, i - 0.45, i + 0.45, colors="black", linestyles="--")
    ax.set_title("throughput (dashed: best uniform plan, predicted)")
    bx.set_title("peak memory per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(
    uri: str,
    run_ids: list[str],
    experiment: str | None,
    fmt: Format,
    console: Console,
    sweep: str | None = None,
    record: bool = False,
    wide: bool = False,
    uri_option: str = "tracking.uri",
) -> list[Row]:
    """Print the runs side by side; `record`: also log the comparison (table, JSON, chart) as a run of
    its own (a sweep does; reading runs writes nothing otherwise). `uri_option` names where `uri` came from."""
    records = run_records(uri, run_ids, experiment, sweep, uri_option)
    if not records:
        raise UserError(
            "--experiment",
            experiment,
            "holds no plan or train runs to compare",
            "run submit, sweep or plan --track first, or pass run ids",
        )
    rows = [row_of(r) for r in records]
    if fmt == "table":
        # a console as wide as the table: the table's own width decides, not the terminal's
        (Console(file=console.file, width=WIDE_CONSOLE) if wide else console).print(as_table(rows, wide))
    else:
        console.print(
            as_json(rows) if fmt == "json" else as_markdown(rows), markup=False, highlight=False, soft_wrap=True
        )
    if not record:
        return rows
    tracker = RunTracker.start_comparison(
        uri, records[0].experiment_id, [r.run_id for r in rows], {Tag.SWEEP: sweep} if sweep else None
    )
    tracker.log_text(as_markdown(rows), "comparison.md")
    tracker.log_text(as_json(rows), "comparison.json")
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_file(chart(rows, Path(tmp) / "comparison.png"))
    tracker.finish()
    note = Console(stderr=True) if fmt == "json" else console  # JSON on stdout stays parseable
    note.print(f"comparison logged as MLflow run {tracker.run_id}", markup=False, highlight=False)
    return rows
