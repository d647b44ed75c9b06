"""`submit`: recipe -> planner actor -> Ray Train FSDP2 workers -> MLflow, with live progress."""

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from osdp_planners.plan import Plan
from osdp_platform.checkpoint import check_resumable, find_resume_point, storage_root
from osdp_platform.cluster import check_cluster, check_local_devices, connect
from osdp_platform.planning import plan_on_sample_worker
from osdp_platform.progress import MetricsInbox, MetricsPump
from osdp_platform.recipe import Recipe
from osdp_platform.tracking import RunTracker
from osdp_platform.worker import WorkerConfig, train_loop


@dataclass
class RunSummary:
    run_id: str
    plan: Plan
    steps: list[dict[str, float]] = field(default_factory=list)
    first_step: int = 0  # above 0 when resumed from a checkpoint

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Keep one entry per step: a restart from a checkpoint re-runs steps, and the re-run wins."""
        del self.steps[step - self.first_step:]
        self.steps.append(metrics)

    def measured(self) -> dict[str, float]:
        """Aggregates: timing from steps without a memory probe (the probe slows CPU steps)."""
        timed = [s for s in self.steps[1:] if "peak_memory_bytes" not in s] or self.steps
        peaks = [s["peak_memory_bytes"] for s in self.steps if "peak_memory_bytes" in s]
        out = {
            "first_loss": self.steps[0]["loss"],
            "final_loss": self.steps[-1]["loss"],
            "measured_step_time_s": statistics.median(s["step_time_s"] for s in timed),
        }
        out["measured_throughput_samples_per_s"] = self.plan.global_batch_size / out["measured_step_time_s"]
        if peaks:
            out["measured_peak_memory_bytes"] = max(peaks)
        pred = self.plan.predicted
        if pred.step_time_s:
            out["step_time_ratio"] = out["measured_step_time_s"] / pred.step_time_s
        if pred.peak_memory_bytes and peaks:
            out["peak_memory_ratio"] = out["measured_peak_memory_bytes"] / pred.peak_memory_bytes
        return out


def _table(recipe: Recipe, summary: RunSummary) -> Table:
    m, plan = summary.measured(), summary.plan
    table = Table(title=f"{recipe.name}: {plan.model} on {plan.world_size} worker(s), planner {plan.planner}")
    table.add_column("metric")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    pred = plan.predicted
    mib = 1024**2
    table.add_row("loss (first -> final)", f"{m['first_loss']:.4f} -> {m['final_loss']:.4f}", "")
    table.add_row("step time (s, median)", f"{m['measured_step_time_s']:.4f}",
                  f"{pred.step_time_s:.4f}" if pred.step_time_s else "-")
    table.add_row("throughput (samples/s)", f"{m['measured_throughput_samples_per_s']:.1f}",
                  f"{pred.throughput_samples_per_s:.1f}" if pred.throughput_samples_per_s else "-")
    table.add_row("peak memory (MiB, max over ranks)",
                  f"{m['measured_peak_memory_bytes'] / mib:.1f}" if "measured_peak_memory_bytes" in m else "-",
                  f"{pred.peak_memory_bytes / mib:.1f}" if pred.peak_memory_bytes else "-")
    table.add_row("batch (micro x accum x workers)",
                  f"{plan.micro_batch_size} x {plan.grad_accum_steps} x {plan.world_size}", "")
    table.add_row("MLflow run", summary.run_id, "")
    return table


def submit(recipe: Recipe, address: str | None = None, console: Console | None = None, resume: str | None = None,
           train_fn: Callable[[dict[str, Any]], None] = train_loop) -> RunSummary:
    """Plan and train `recipe`; `resume` is an earlier run's MLflow id to continue from its last checkpoint.

    A resumed run is a new MLflow run (tagged resumed_from_run): it may use another plan or worker count,
    and one run's params and predictions describe one plan. `train_fn` wraps or replaces the worker loop.
    """
    console = console or Console()
    check_local_devices(recipe, address)
    point = find_resume_point(recipe, resume) if resume else None
    connect(recipe, address)
    check_cluster(recipe)
    console.print(f"[bold]planning[/] {recipe.model.label} with planner {recipe.planner.name} on a sample worker")
    plan, profile = plan_on_sample_worker(recipe)
    if point is not None:
        check_resumable(point, recipe, plan)
    tracker = RunTracker.start(recipe, plan)
    tracker.log_text(profile, "profile.json")
    summary = RunSummary(tracker.run_id, plan, first_step=point.step if point else 0)
    if point is not None:
        for key, value in (("resumed_from_run", point.run_id), ("resumed_from_checkpoint", point.path),
                           ("resumed_at_step", str(point.step))):
            tracker.client.set_tag(tracker.run_id, key, value)
        console.print(f"resuming run {point.run_id} at step {point.step} from {point.path}")
    inbox = MetricsInbox.remote()
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=dict(WorkerConfig(recipe=recipe, plan=plan, inbox=inbox,
                                            resume_from=point.path if point else None,
                                            checkpoint_root=storage_root(recipe.train))),
        scaling_config=ScalingConfig(num_workers=recipe.hardware.world_size,
                                     use_gpu=recipe.hardware.accelerator == "gpu",
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"{recipe.name}-{tracker.run_id[:8]}",
                             storage_path=storage_root(recipe.train),
                             checkpoint_config=CheckpointConfig(num_to_keep=recipe.train.checkpoints_to_keep),
                             failure_config=FailureConfig(max_failures=recipe.train.max_failures)),
    )
    done = threading.Event()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, refresh_per_second=2) as progress:
        task = progress.add_task("training", total=recipe.train.steps, completed=summary.first_step)

        def on_metrics(step: int, metrics: dict[str, float]) -> None:
            summary.record(step, metrics)
            progress.update(task, completed=step + 1,
                            description=f"loss {metrics['loss']:.3f}  {metrics['tokens_per_s']:.0f} tok/s")

        pump = threading.Thread(target=MetricsPump(inbox, tracker, on_metrics).run, args=(done,), daemon=True)
        pump.start()
        try:
            trainer.fit()
        except BaseException:
            tracker.finish("FAILED")
            raise
        finally:
            done.set()
            pump.join()
    tracker.log_metrics(summary.measured(), step=recipe.train.steps)
    tracker.finish()
    console.print(_table(recipe, summary))
    return summary
