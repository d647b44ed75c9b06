"""MLflow in one place: every tag, param, metric and artifact the platform writes, every read of run data.

A run is one of three kinds (tag `run_kind`): `train` (one per submit), `plan` (`plan --track`, or a
sweep cell that does not fit) and `comparison` (`compare`). Only the driver writes, so any tracking
store works. A tracking server that stops answering during a run does not stop training: the writes
wait on local disk (pending.py) and are uploaded in order as soon as it answers again, at the latest
when the run ends; if it is still gone then, `osdp-platform sync FOLDER` uploads them later.
"""

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import requests
from mlflow.entities import Metric as MlflowMetric
from mlflow.entities import Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils import git_utils
from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT, MLFLOW_GIT_REPO_URL, MLFLOW_RUN_NOTE

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan, Strategy
from osdp_platform.recipe.loader import flatten, recipe_to_yaml
from osdp_platform.recipe.schema import Recipe
from osdp_platform.tracking.pending import PendingWrites, Write

MAX_METRICS_PER_BATCH = 1000  # MLflow's limits for one log_batch
MAX_PARAMS_PER_BATCH = 100
MAX_LIST_PARAM_CHARS = 1000  # unit lists in params are cut here; the plan table artifact has them all
PENDING_DIR = "mlflow-pending"  # under the working directory, one folder per run
RETRY_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 2.0
UNREACHABLE = (MlflowException, requests.RequestException, OSError)

log = logging.getLogger(__name__)


class Tag(StrEnum):
    KIND = "run_kind"  # RunKind
    PLANNER = "planner"
    MODEL = "model"
    WORLD_SIZE = "world_size"
    HARDWARE = "hardware"  # the pool: nodes x workers per node, preset
    STRUCTURE_HASH = "structure_hash"
    RECIPE_HASH = "recipe_hash"
    PLAN_HASH = "plan_hash"  # the plan's decisions, not its predictions
    PLAN_STATUS = "plan_status"  # plan runs: PLANNED or DOES_NOT_FIT
    CHECKPOINT_PATH = "checkpoint_path"
    CHECKPOINT_STEP = "checkpoint_step"  # the step a resume continues at
    RESUMED_FROM_RUN = "resumed_from_run"
    RESUMED_FROM_CHECKPOINT = "resumed_from_checkpoint"
    RESUMED_AT_STEP = "resumed_at_step"
    COMPARED_RUNS = "compared_runs"
    SWEEP = "sweep"  # the sweep a run belongs to
    RESTARTS = "restarts"  # how often Ray Train restarted the workers after a failure


class RunKind(StrEnum):
    TRAIN = "train"
    PLAN = "plan"
    COMPARISON = "comparison"


STRATEGIES = [s.value for s in Strategy]
PLANNED = "planned"
DOES_NOT_FIT = "does not fit"


class Metric(StrEnum):
    """Run-level metrics; the per-step ones are the worker's (loss, step_time_s, tokens_per_s, ...)."""

    PREDICTED_PEAK_MEMORY = "predicted_peak_memory_bytes"  # allocated
    PREDICTED_RESERVED_MEMORY = "predicted_reserved_memory_bytes"  # the allocator's reserve (GPU)
    PREDICTED_STEP_TIME = "predicted_step_time_s"
    PREDICTED_THROUGHPUT = "predicted_throughput_samples_per_s"
    MEASURED_PEAK_MEMORY = "measured_peak_memory_bytes"
    MEASURED_RESERVED_MEMORY = "measured_reserved_memory_bytes"
    MEASURED_STEP_TIME = "measured_step_time_s"
    MEASURED_THROUGHPUT = "measured_throughput_samples_per_s"
    PEAK_MEMORY_RATIO = "peak_memory_ratio"  # measured / predicted
    RESERVED_MEMORY_RATIO = "reserved_memory_ratio"
    STEP_TIME_RATIO = "step_time_ratio"
    FIRST_LOSS = "first_loss"
    FINAL_LOSS = "final_loss"
    RESTARTS = "restarts"  # one point per restart of the workers, at the step they resumed from


def baseline_metric(strategy: str, quantity: str) -> str:
    """A uniform plan's prediction, e.g. baseline_zero3_throughput_samples_per_s (plan.baselines)."""
    return f"baseline_{strategy}_{quantity}"


def system_metric(node: str, name: str) -> str:
    """MLflow's naming for a node's system metrics, so its UI shows them as system metrics."""
    return f"system/{node}/{name}"


def _digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def recipe_hash(recipe: Recipe) -> str:
    """What was asked for: the recipe without its run name and tracking section."""
    return _digest(recipe.model_dump(mode="json", exclude={"name", "tracking"}))


def plan_hash(plan: Plan) -> str:
    """What was decided: two plans with equal hashes train alike, whatever their predictions."""
    decided = plan.model_dump(mode="json", exclude={"predicted", "baselines"})
    for unit in decided["units"]:
        unit.pop("predicted_memory_bytes")
        unit.pop("predicted_time_s")
    return _digest(decided)


def hardware_label(recipe: Recipe) -> str:
    hw = recipe.hardware
    nodes = f"{hw.min_nodes}-{hw.max_nodes}" if hw.elastic else str(hw.nodes)
    return f"{nodes}x{hw.workers_per_node} {hw.preset}"


def _names(items: list[str]) -> str:
    text = " ".join(items)
    return text if len(text) <= MAX_LIST_PARAM_CHARS else text[:MAX_LIST_PARAM_CHARS] + " ..."


def plan_params(plan: Plan) -> dict[str, str]:
    """The plan's shape in a few params: batch, units per strategy, split factors, checkpointed units."""
    out: dict[str, int | str] = {
        "plan.micro_batch_size": plan.micro_batch_size,
        "plan.grad_accum_steps": plan.grad_accum_steps,
        "plan.global_batch_size": plan.global_batch_size,
        "plan.world_size": plan.world_size,
        "plan.units": len(plan.units),
    }
    for u in plan.units:
        kind = f"hsdp_g{u.shard_group_size}" if u.strategy.value == "hsdp" else u.strategy.value
        out[f"plan.units.{kind}"] = int(out.get(f"plan.units.{kind}", 0)) + 1
        if u.split > 1:
            out[f"plan.units.split_{u.split}"] = int(out.get(f"plan.units.split_{u.split}", 0)) + 1
    out["plan.units.checkpointed"] = sum(u.checkpoint for u in plan.units)
    out["plan.split_units"] = _names([f"{u.name}={u.split}" for u in plan.units if u.split > 1]) or "-"
    out["plan.checkpointed_units"] = _names([u.name for u in plan.units if u.checkpoint]) or "-"
    return {k: str(v) for k, v in out.items()}


def plan_metrics(plan: Plan) -> dict[str, float]:
    """The planner's predictions for this plan and for every uniform plan, at one step so they chart together."""
    p = plan.predicted
    values: dict[str, float | None] = {
        Metric.PREDICTED_PEAK_MEMORY: p.peak_memory_bytes,
        Metric.PREDICTED_RESERVED_MEMORY: p.reserved_memory_bytes,
        Metric.PREDICTED_STEP_TIME: p.step_time_s,
        Metric.PREDICTED_THROUGHPUT: p.throughput_samples_per_s,
    }
    for name, b in plan.baselines.items():
        values[baseline_metric(name, "fits")] = float(b.fits)
        values[baseline_metric(name, "micro_batch_size")] = b.micro_batch_size
        values[baseline_metric(name, "peak_memory_bytes")] = b.peak_memory_bytes
        values[baseline_metric(name, "step_time_s")] = b.step_time_s
        values[baseline_metric(name, "throughput_samples_per_s")] = b.throughput_samples_per_s
    return {k: float(v) for k, v in values.items() if v is not None}


def _answers(uri: str) -> bool:
    """Whether the tracking server is up; stores that are not servers always count as up."""
    if not uri.startswith(("http://", "https://")):
        return True
    try:
        return requests.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).ok
    except requests.RequestException:
        return False


def check_reachable(uri: str) -> None:
    """Refuse before anything starts when the tracking server does not answer; later, writes wait instead."""
    if uri.startswith(("http://", "https://")):
        # MLflow's default retries a dead server for minutes per request; waiting writes make that needless
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    if not _answers(uri):
        raise UserError(
            "tracking.uri",
            uri,
            "the MLflow tracking server does not answer",
            "start it (mlflow server ...), or leave tracking.uri unset for a local sqlite file",
        )


def _source_tags() -> dict[str, str]:
    """MLflow's own user/source/git tags; git from the working directory when the entry point is not in a repo."""
    tags = resolve_tags()
    if MLFLOW_GIT_COMMIT not in tags:
        here = os.getcwd()
        found = {
            MLFLOW_GIT_COMMIT: git_utils.get_git_commit(here),
            MLFLOW_GIT_BRANCH: git_utils.get_git_branch(here),
            MLFLOW_GIT_REPO_URL: git_utils.get_git_repo_url(here),
        }
        tags |= {k: v for k, v in found.items() if v}
    return tags


def _experiment_id(client: MlflowClient, name: str) -> str:
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


@dataclass
class RunTracker:
    """Owns one MLflow run. Writes that the server does not take wait in `pending_root/<run id>`."""

    uri: str
    run_id: str
    warn: Callable[[str], None] = log.warning
    wait_for_server_s: float = 0.0  # how long the run's end waits for a server that went away
    pending_root: Path = field(default_factory=lambda: Path(PENDING_DIR).resolve())
    pending: PendingWrites | None = None

    @classmethod
    def create(
        cls,
        uri: str,
        experiment: str,
        name: str,
        tags: Mapping[str, str],
        warn: Callable[[str], None] | None = None,
        wait_for_server_s: float = 0.0,
    ) -> "RunTracker":
        check_reachable(uri)
        client = MlflowClient(uri)
        tags = _source_tags() | {str(k): str(v) for k, v in tags.items()}
        run = client.create_run(_experiment_id(client, experiment), run_name=name, tags=tags)
        return cls(uri, run.info.run_id, warn=warn or log.warning, wait_for_server_s=wait_for_server_s)

    @classmethod
    def start(
        cls,
        recipe: Recipe,
        kind: RunKind,
        plan: Plan | None = None,
        tags: Mapping[str, str] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> "RunTracker":
        """A run for `recipe` with its tags, params, recipe.yaml and, given a plan, the plan and its predictions."""
        ours = {
            Tag.KIND: kind,
            Tag.PLANNER: recipe.planner.name,
            Tag.MODEL: recipe.model.label,
            Tag.HARDWARE: hardware_label(recipe),
            Tag.WORLD_SIZE: str(recipe.hardware.world_size),
            Tag.RECIPE_HASH: recipe_hash(recipe),
        }
        if plan is not None:
            ours |= {Tag.STRUCTURE_HASH: plan.structure_hash, Tag.PLAN_HASH: plan_hash(plan)}
        if kind is RunKind.PLAN:
            ours[Tag.PLAN_STATUS] = PLANNED if plan is not None else DOES_NOT_FIT
        tracker = cls.create(
            recipe.tracking.resolved_uri,
            recipe.tracking.experiment,
            recipe.name,
            ours | dict(tags or {}),
            warn,
            recipe.tracking.wait_for_server_s,
        )
        params = sorted((flatten(recipe) | (plan_params(plan) if plan is not None else {})).items())
        client = MlflowClient(tracker.uri)
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(tracker.run_id, params=[Param(k, v) for k, v in params[i : i + MAX_PARAMS_PER_BATCH]])
        client.log_text(tracker.run_id, recipe_to_yaml(recipe), "recipe.yaml")
        if plan is not None:
            client.log_text(tracker.run_id, plan.to_json(), "plan.json")
            tracker.log_metrics(plan_metrics(plan), step=0)
        return tracker

    @classmethod
    def start_comparison(
        cls, uri: str, experiment_id: str, run_ids: list[str], tags: Mapping[str, str] | None = None
    ) -> "RunTracker":
        experiment = MlflowClient(uri).get_experiment(experiment_id).name
        ours = {Tag.KIND: RunKind.COMPARISON, Tag.COMPARED_RUNS: " ".join(run_ids)}
        return cls.create(uri, experiment, "comparison", ours | dict(tags or {}))

    # writes: each goes to the server, or waits on disk while the server does not answer

    def log_samples(self, samples: Iterable[tuple[int, int, Mapping[str, float]]]) -> None:
        """(step, time in ms, metrics) rows, each stamped with its own time, in as few requests as MLflow allows."""
        rows = [[str(k), float(v), ms, step] for step, ms, metrics in samples for k, v in metrics.items()]
        for i in range(0, len(rows), MAX_METRICS_PER_BATCH):
            self._write({"kind": "metrics", "rows": rows[i : i + MAX_METRICS_PER_BATCH]})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_samples([(step, int(time.time() * 1000), metrics)])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._write({"kind": "tags", "tags": {str(k): str(v) for k, v in tags.items()}})

    def note(self, text: str) -> None:
        """The run's description in the MLflow UI."""
        self.set_tags({MLFLOW_RUN_NOTE: text})

    def record_checkpoint(self, step: int, path: str) -> None:
        """Every rank's files for the checkpoint are stored at `path`; a resume continues at `step`."""
        self.set_tags({Tag.CHECKPOINT_PATH: path, Tag.CHECKPOINT_STEP: str(step)})

    def record_restart(self, count: int, step: int) -> None:
        """The workers started again after a failure, at `step`: the count as a tag, and each restart as a
        point of the `restarts` metric at the step it resumed from (the run's timeline shows where)."""
        self.set_tags({Tag.RESTARTS: str(count)})
        self.log_metrics({Metric.RESTARTS: float(count)}, step)

    def record_resume(self, run_id: str, path: str, step: int) -> None:
        self.set_tags({Tag.RESUMED_FROM_RUN: run_id, Tag.RESUMED_FROM_CHECKPOINT: path, Tag.RESUMED_AT_STEP: str(step)})

    def log_text(self, text: str, name: str) -> None:
        self._write({"kind": "text", "text": text, "name": name})

    def log_file(self, path: Path, artifact_path: str | None = None) -> None:
        self._write({"kind": "file", "file": str(path), "artifact_path": artifact_path})

    def finish(self, status: str = "FINISHED") -> None:
        """End the run; writes still waiting get `wait_for_server_s` for the server to come back."""
        self._write({"kind": "end", "status": status, "end_time": int(time.time() * 1000)})
        if self.pending is None:
            return
        try:
            if self.wait_for_server_s > 0:
                self.warn(
                    f"waiting up to {self.wait_for_server_s:.0f} s for MLflow at {self.uri} to answer "
                    "(Ctrl-C stops waiting; nothing is lost)"
                )
                deadline = time.monotonic() + self.wait_for_server_s
                while not self._catch_up() and time.monotonic() < deadline:
                    time.sleep(RETRY_EVERY_S)
        finally:
            if self.pending is not None:
                self.warn(
                    f"MLflow at {self.uri} still does not answer: {len(self.pending.writes())} writes of "
                    f"run {self.run_id} (metrics, tags, artifacts, its end) are kept in {self.pending.folder}; "
                    f"upload them with `osdp-platform sync {self.pending.folder}`"
                )

    @classmethod
    def sync(cls, folder: Path, warn: Callable[[str], None] | None = None) -> bool:
        """Upload the writes a run left in `folder`; False if the server still does not answer."""
        pending = PendingWrites(folder)
        uri, run_id = pending.run()
        check_reachable(uri)
        return cls(uri, run_id, warn=warn or log.warning, pending_root=folder.parent, pending=pending)._catch_up()

    def _write(self, write: Write) -> None:
        if self.pending is not None and not self._catch_up():
            self._keep(write)
            return
        try:
            self._apply(write, Path("/"))
        except UNREACHABLE as exc:
            if _answers(self.uri):
                raise
            folder = self._keep(write)
            reason = str(exc).splitlines()[0][:160]
            self.warn(
                f"MLflow at {self.uri} does not answer ({reason}); training goes on, and this run's "
                f"metrics, tags and artifacts are kept in {folder} and uploaded when it answers again"
            )

    def _keep(self, write: Write) -> Path:
        if self.pending is None:
            self.pending = PendingWrites.create(self.pending_root / self.run_id, self.uri, self.run_id)
        if write["kind"] == "file":
            write = write | {"file": self.pending.keep_file(Path(write["file"]))}
        self.pending.append(write)
        return self.pending.folder

    def _catch_up(self) -> bool:
        """Upload waiting writes in order; True once none is left."""
        assert self.pending is not None
        if not _answers(self.uri):
            return False
        writes = self.pending.writes()
        for write in writes:
            try:
                self._apply(write, self.pending.folder)
            except UNREACHABLE:
                if _answers(self.uri):
                    raise
                return False
            self.pending.drop_first(1)
        self.warn(f"MLflow at {self.uri} is back: {len(writes)} waiting writes uploaded from {self.pending.folder}")
        self.pending.remove()
        self.pending = None
        return True

    def _apply(self, write: Write, base: Path) -> None:
        client = MlflowClient(self.uri)
        kind = write["kind"]
        if kind == "metrics":
            client.log_batch(self.run_id, metrics=[MlflowMetric(k, v, ms, step) for k, v, ms, step in write["rows"]])
        elif kind == "tags":
            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in write["tags"].items()])
        elif kind == "text":
            client.log_text(self.run_id, write["text"], write["name"])
        elif kind == "file":
            client.log_artifact(self.run_id, str(base / write["file"]), write["artifact_path"])
        else:
            client.set_terminated(self.run_id, status=write["status"], end_time=write["end_time"])


# reads


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


def run_records(uri: str, run_ids: list[str], experiment: str | None, sweep: str | None = None) -> list[RunRecord]:
    """The runs named, else every plan and train run of `experiment` (of one sweep, if given), oldest first."""
    check_reachable(uri)
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
                    "pass ids that submit, plan --track or sweep printed, with the same --uri",
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
