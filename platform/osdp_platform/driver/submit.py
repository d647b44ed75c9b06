"""`submit`: recipe -> planner actor -> Ray Train FSDP2 workers -> MLflow, with live progress."""

import os
import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from osdp_planners import PlanResult
from osdp_planners.plan import Plan
from osdp_planners.units import structure_hash
from osdp_platform.driver.cluster import beside_the_driver, check_cluster, connect, pool_request
from osdp_platform.driver.elastic import ElasticRun, asking_for_max_nodes, wait_for_nodes
from osdp_platform.driver.pump import MetricsPump
from osdp_platform.driver.resume import ResumePoint, check_resumable, find_resume_point
from osdp_platform.driver.system_metrics import NodeSamplers
from osdp_platform.planning.sample_worker import plan_on_sample_worker
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.inbox import MetricsInbox
from osdp_platform.runtime.models import build_model
from osdp_platform.runtime.worker import WorkerConfig, train_loop
from osdp_platform.runtime.worker_env import worker_env
from osdp_platform.tracking.plan_versions import record_plan_version
from osdp_platform.tracking.report import log_report, slow_times
from osdp_platform.tracking.runs import Metric, RunKind, RunTracker, check_reachable

RANK_PEAK_PREFIX = "peak_memory_bytes/rank"  # the worker's per-rank peaks (worker.StepMetrics)
# Ray Train starts an actor per worker group that polls for draining nodes, for a loop that reads
# ray.train.get_preemption_info; train_loop never does (an elastic run's driver counts the nodes itself),
# so it would cost a process (about 1.5 s of CPU) on every submit for nothing. A user's own value wins.
RAY_TRAIN_PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


@dataclass
class RunSummary:
    run_id: str
    plan: Plan
    steps: list[dict[str, float]] = field(default_factory=list)
    first_step: int = 0  # above 0 when resumed from a checkpoint

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Keep one entry per step: a restart from a checkpoint re-runs steps, and the re-run wins."""
        del self.steps[step - self.first_step :]
        self.steps.append(metrics)

    def steady_steps(self) -> list[dict[str, float]]:
        """The steps that time the run: its second half, less the steps with a memory probe.

        The first half is warm-up: allocator and gloo buffers fill, and the run's other processes
        (Ray Train's actors, the metrics pump, node samplers) start beside the workers; on a 2-core
        node that doubled the time of the first ten steps. A memory probe slows a CPU step. A run too
        short for that falls back to every unprobed step after the first.
        """
        unprobed = [s for s in self.steps if "peak_memory_bytes" not in s]
        late = [s for s in self.steps[len(self.steps) // 2 :] if "peak_memory_bytes" not in s]
        return late or unprobed[1:] or unprobed or self.steps

    def measured(self) -> dict[str, float]:
        """Aggregates: the median step time of the steady state (`steady_steps`), the peak of every probe."""
        timed = self.steady_steps()
        peaks = [s["peak_memory_bytes"] for s in self.steps if "peak_memory_bytes" in s]
        out: dict[str, float] = {
            Metric.FIRST_LOSS: self.steps[0]["loss"],
            Metric.FINAL_LOSS: self.steps[-1]["loss"],
            Metric.MEASURED_STEP_TIME: statistics.median(s["step_time_s"] for s in timed),
        }
        out[Metric.MEASURED_THROUGHPUT] = self.plan.global_batch_size / out[Metric.MEASURED_STEP_TIME]
        if peaks:
            out[Metric.MEASURED_PEAK_MEMORY] = max(peaks)
        waits = [s["cpu_wait_share"] for s in timed if "cpu_wait_share" in s]
        if waits:  # a slow step beside a high share was slowed by its host, not by its plan
            out[Metric.MEASURED_CPU_WAIT] = statistics.median(waits)
        pred = self.plan.predicted
        if pred.step_time_s:
            out[Metric.STEP_TIME_RATIO] = out[Metric.MEASURED_STEP_TIME] / pred.step_time_s
        if pred.peak_memory_bytes and peaks:
            out[Metric.PEAK_MEMORY_RATIO] = out[Metric.MEASURED_PEAK_MEMORY] / pred.peak_memory_bytes
        reserved = [s["reserved_memory_bytes"] for s in self.steps if "reserved_memory_bytes" in s]
        if reserved:
            out[Metric.MEASURED_RESERVED_MEMORY] = max(reserved)
            if pred.reserved_memory_bytes:
                out[Metric.RESERVED_MEMORY_RATIO] = max(reserved) / pred.reserved_memory_bytes
        return dict(out)

    def rank_peaks(self) -> list[float]:
        """Each rank's highest measured peak (empty where the worker logged none per rank)."""
        ranks = sorted(
            {int(k.removeprefix(RANK_PEAK_PREFIX)) for s in self.steps for k in s if k.startswith(RANK_PEAK_PREFIX)}
        )
        return [max(s.get(f"{RANK_PEAK_PREFIX}{r}", 0.0) for s in self.steps) for r in ranks]


def _table(recipe: Recipe, summary: RunSummary) -> Table:
    m, plan = summary.measured(), summary.plan
    table = Table(title=f"{recipe.name}: {plan.model} on {plan.world_size} worker(s), planner {plan.planner}")
    table.add_column("metric")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    pred = plan.predicted
    mib = 1024**2
    table.add_row("loss (first -> final)", f"{m[Metric.FIRST_LOSS]:.4f} -> {m[Metric.FINAL_LOSS]:.4f}", "")
    table.add_row(
        "step time (s, median of the 2nd half)",
        f"{m[Metric.MEASURED_STEP_TIME]:.4f}",
        f"{pred.step_time_s:.4f}" if pred.step_time_s else "-",
    )
    table.add_row(
        "throughput (samples/s)",
        f"{m[Metric.MEASURED_THROUGHPUT]:.1f}",
        f"{pred.throughput_samples_per_s:.1f}" if pred.throughput_samples_per_s else "-",
    )
    peak = m.get(Metric.MEASURED_PEAK_MEMORY)
    table.add_row(
        "peak memory (MiB, max over ranks)",
        f"{peak / mib:.1f}" if peak is not None else "-",
        f"{pred.peak_memory_bytes / mib:.1f}" if pred.peak_memory_bytes else "-",
    )
    table.add_row(
        "batch (micro x accum x workers)", f"{plan.micro_batch_size} x {plan.grad_accum_steps} x {plan.world_size}", ""
    )
    table.add_row("MLflow run", summary.run_id, "")
    return table


def ray_logs_hint(console: Console) -> None:
    console.print(
        "Ray's logs and the workers' output: /tmp/ray/session_latest/logs on the head node (--verbose shows them here)",
        style="dim",
        markup=False,
    )


def warn_on(console: Console) -> Callable[[str], None]:
    """Tracking warnings (a server that went away) printed where the user looks."""
    return lambda message: console.print(f"warning: {message}", style="yellow", markup=False, highlight=False)


def _say(console: Console) -> Callable[[str], None]:
    return lambda text: console.print(text, markup=False, highlight=False)


def _train(
    fit: Callable[[], object], recipe: Recipe, summary: RunSummary, tracker: RunTracker, inbox: Any, console: Console
) -> None:
    """Run the workers with a progress bar while the pump moves their metrics, and node samples, to MLflow."""
    done = threading.Event()
    samplers = NodeSamplers(inbox).start()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, refresh_per_second=2) as progress:
        task = progress.add_task("training", total=recipe.train.steps, completed=summary.first_step)

        def on_metrics(step: int, metrics: dict[str, float]) -> None:
            summary.record(step, metrics)
            progress.update(
                task, completed=step + 1, description=f"loss {metrics['loss']:.3f}  {metrics['tokens_per_s']:.0f} tok/s"
            )

        pump = threading.Thread(target=MetricsPump(inbox, tracker, on_metrics).run, args=(done,), daemon=True)
        pump.start()
        try:
            fit()
        finally:
            samplers.stop()
            done.set()
            pump.join()


def _trainer(
    recipe: Recipe,
    plan: Plan,
    inbox: Any,
    point: ResumePoint | None,
    train_fn: Callable[[dict[str, Any]], None],
    name: str,
) -> TorchTrainer:
    """One worker group of `plan.world_size` workers (an elastic run starts one per world size it has)."""
    os.environ.setdefault(RAY_TRAIN_PREEMPTION_WATCHER, "0")  # read from the driver's environment by Ray Train
    return TorchTrainer(
        train_fn,
        train_loop_config=dict(
            WorkerConfig(
                recipe=recipe,
                plan=plan,
                inbox=inbox,
                resume_from=point.path if point else None,
                checkpoint_root=recipe.train.storage_root,
                elastic=recipe.hardware.elastic,
            )
        ),
        scaling_config=ScalingConfig(
            num_workers=plan.world_size,
            use_gpu=recipe.hardware.accelerator == "gpu",
            resources_per_worker={"CPU": 1, **pool_request(recipe.hardware)},
        ),
        # ray.train's RunConfig is Train V2's at run time (worker_runtime_env); mypy reads the V1 class
        run_config=RunConfig(  # type: ignore[call-arg]
            name=name,
            storage_path=recipe.train.storage_root,
            checkpoint_config=CheckpointConfig(num_to_keep=recipe.train.checkpoints_to_keep),
            # an elastic run restarts its groups itself (driver/elastic.py), re-planned for the nodes there
            failure_config=FailureConfig(max_failures=0 if recipe.hardware.elastic else recipe.train.max_failures),
            worker_runtime_env={"env_vars": worker_env(os.environ)},
        ),
    )


def submit(
    recipe: Recipe,
    address: str | None = None,
    console: Console | None = None,
    resume: str | None = None,
    train_fn: Callable[[dict[str, Any]], None] = train_loop,
    planned: PlanResult | None = None,
    tags: Mapping[str, str] | None = None,
    verbose: bool = False,
) -> RunSummary:
    """Plan and train `recipe`; `resume` is an earlier run's MLflow id to continue from its last checkpoint.

    A resumed run is a new MLflow run (tagged resumed_from_run): it may use another plan or worker count,
    and one run's params and predictions describe one plan. `train_fn` wraps or replaces the worker loop;
    `planned` is a plan already made on a sample worker (sweep); `tags` go on the run; `verbose` lets Ray's
    own logs and the workers' output through to the terminal.
    """
    console = console or Console()
    point = find_resume_point(recipe, resume) if resume else None
    if point is not None:  # another model is refused here, before a planner actor starts for it
        check_resumable(point, recipe, structure_hash(build_model(recipe.model, "meta")))
    check_reachable(recipe.tracking.resolved_uri)
    connect(recipe, address, verbose)
    check_cluster(recipe)
    with asking_for_max_nodes(recipe.hardware):
        return _plan_and_train(recipe, console, point, train_fn, planned, tags)


def _plan_and_train(
    recipe: Recipe,
    console: Console,
    point: ResumePoint | None,
    train_fn: Callable[[dict[str, Any]], None],
    planned: PlanResult | None,
    tags: Mapping[str, str] | None,
) -> RunSummary:
    """Plan for the nodes there (a fixed pool: all of them) and train, on a connected cluster."""
    hw = recipe.hardware
    nodes = wait_for_nodes(hw) if hw.elastic else hw.nodes
    if planned is None or planned.plan.nodes != nodes:  # a sweep's plan is for an elastic pool's largest
        pool = f" on {nodes} of {hw.min_nodes}..{hw.max_nodes} node(s) there" if hw.elastic else ""
        console.print(
            f"[bold]planning[/] {recipe.model.label} with planner {recipe.planner.name}{pool} on a sample worker"
        )
        planned = plan_on_sample_worker(recipe.at_nodes(nodes))
    plan = planned.plan
    if slow := slow_times(plan):
        warn_on(console)(slow)
    tracker = RunTracker.start(recipe, RunKind.TRAIN, plan, tags, warn=warn_on(console))
    tracker.log_text(planned.explanation.computed_from, "profile.json")
    summary = RunSummary(tracker.run_id, plan, first_step=point.step if point else 0)
    if point is not None:
        tracker.record_resume(point.run_id, point.path, point.step)
        console.print(f"resuming run {point.run_id} at step {point.step} from {point.path}")
    inbox = MetricsInbox.options(scheduling_strategy=beside_the_driver()).remote()  # type: ignore[attr-defined]

    def start(result: PlanResult, group: int) -> TorchTrainer:
        suffix = f"-g{group}" if group else ""
        return _trainer(recipe, result.plan, inbox, point, train_fn, f"{recipe.name}-{tracker.run_id[:8]}{suffix}")

    def on_plan(version: int, step: int, result: PlanResult) -> None:
        record_plan_version(tracker, version, step, result.plan)
        summary.plan = result.plan

    elastic = ElasticRun(recipe, planned, nodes, inbox, start, on_plan, _say(console)) if hw.elastic else None
    if elastic is not None:
        on_plan(1, summary.first_step, planned)
    try:
        _train(elastic.run if elastic else start(planned, 0).fit, recipe, summary, tracker, inbox, console)
    except BaseException:
        tracker.finish("FAILED")
        raise
    if elastic is not None:
        planned = elastic.results[-1]
    measured = summary.measured()
    tracker.log_metrics(measured, step=recipe.train.steps)
    log_report(tracker, planned, summary.rank_peaks(), measured[Metric.MEASURED_STEP_TIME])
    tracker.finish()
    console.print(_table(recipe, summary))
    return summary
