"""Reads of run data: the checkpoint a run recorded (for `submit --resume`) and runs as `compare` shows them."""

import tempfile
from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_platform.tracking.keys import PLANNED, STRATEGIES, RunKind, Tag, baseline_metric
from osdp_platform.tracking.runs import check_readable


@dataclass(frozen=True)
class RecordedCheckpoint:
    """The last checkpoint a run recorded, with the plan it was written under."""

    path: str
    step: int
    plan: Plan


def _plan_of(client: MlflowClient, run_id: str) -> Plan:
    with tempfile.TemporaryDirectory() as tmp:
        return Plan.from_file(client.download_artifacts(run_id, "plan.json", tmp))


def recorded_checkpoint(uri: str, run_id: str) -> RecordedCheckpoint | None:
    """What `--resume RUN_ID` continues from; None if the run wrote no checkpoint."""
    client = MlflowClient(uri)
    try:
        tags = client.get_run(run_id).data.tags
    except MlflowException:
        raise UserError(
            "--resume",
            run_id,
            f"no MLflow run with this id in the tracking store {uri}",
            "pass the run id that submit printed (MLflow run), with the same tracking.uri",
        ) from None
    if Tag.CHECKPOINT_PATH not in tags:
        return None
    return RecordedCheckpoint(tags[Tag.CHECKPOINT_PATH], int(tags[Tag.CHECKPOINT_STEP]), _plan_of(client, run_id))


@dataclass(frozen=True)
class RunRecord:
    """One run as `compare` shows it."""

    run_id: str
    name: str
    experiment_id: str
    kind: str
    status: str  # finished, failed, running, killed; for plan runs PLANNED or DOES_NOT_FIT
    planner: str
    model: str
    note: str
    batch: tuple[int, int, int] | None  # micro batch, accumulation steps, workers of the run's plan
    metrics: dict[str, float]

    def baseline_throughputs(self) -> dict[str, float]:
        """Predicted samples/s of each uniform plan that fits, by strategy."""
        return {
            name: self.metrics[baseline_metric(name, "throughput_samples_per_s")]
            for name in STRATEGIES
            if self.metrics.get(baseline_metric(name, "fits")) == 1.0
            and baseline_metric(name, "throughput_samples_per_s") in self.metrics
        }


def _record(run: Run) -> RunRecord:
    info, data = run.info, run.data
    tags = data.tags
    kind = tags.get(Tag.KIND, RunKind.TRAIN)
    status = tags.get(Tag.PLAN_STATUS, PLANNED) if kind == RunKind.PLAN else info.status.lower()
    micro, accum, world = (data.params.get(f"plan.{k}") for k in ("micro_batch_size", "grad_accum_steps", "world_size"))
    batch = (int(micro), int(accum), int(world)) if micro and accum and world else None
    return RunRecord(
        info.run_id,
        info.run_name or "",
        info.experiment_id,
        kind,
        status,
        tags.get(Tag.PLANNER, ""),
        tags.get(Tag.MODEL, ""),
        tags.get(MLFLOW_RUN_NOTE, ""),
        batch,
        dict(data.metrics),
    )


def run_records(
    uri: str, run_ids: list[str], experiment: str | None, sweep: str | None = None, uri_option: str = "tracking.uri"
) -> list[RunRecord]:
    """The runs named, else every plan and train run of `experiment` (of one sweep, if given), oldest first.
    `uri_option` names where `uri` came from, for the errors."""
    if not run_ids and experiment is None:
        raise UserError(
            "RUN_ID / --experiment",
            None,
            "neither is given: compare needs the runs to show",
            "pass run ids (as submit, plan --track or sweep printed them) or --experiment NAME",
        )
    check_readable(uri, uri_option)
    client = MlflowClient(uri)
    if run_ids:
        runs = []
        for run_id in run_ids:
            try:
                runs.append(client.get_run(run_id))
            except MlflowException:
                raise UserError(
                    "RUN_ID",
                    run_id,
                    f"no MLflow run with this id in {uri}",
                    f"pass ids that submit, plan --track or sweep printed, with the same {uri_option}",
                ) from None
        return [_record(r) for r in runs]
    found = client.get_experiment_by_name(experiment) if experiment else None
    if found is None:
        names = ", ".join(e.name for e in client.search_experiments())
        raise UserError(
            "--experiment",
            experiment,
            f"no such experiment in {uri} (it has: {names or 'none'})",
            "pass --experiment NAME (the recipe's tracking.experiment) or run ids",
        )
    where = f"tags.{Tag.SWEEP} = '{sweep}'" if sweep else ""
    runs = client.search_runs([found.experiment_id], where, max_results=1000, order_by=["attributes.start_time ASC"])
    return [r for r in map(_record, runs) if r.kind != RunKind.COMPARISON]
