"""The MLflow run writer: every tag, param, metric and artifact the platform writes goes through RunTracker
(under the names in keys.py; the reads are in records.py).

A run is one of three kinds (tag `run_kind`): `train` (one per submit), `plan` (`plan --track`, or a
sweep cell that does not fit) and `comparison` (`compare`). Only the driver writes, so any tracking
store works. A tracking server that stops answering during a run does not stop training: the writes
wait on local disk (pending.py) and are uploaded in order as soon as it answers again, at the latest
when the run ends; if it is still gone then, `osdp-platform sync FOLDER` uploads them later.
"""

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import requests
from mlflow.entities import Metric as MlflowMetric
from mlflow.entities import Param, RunTag
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils import git_utils
from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT, MLFLOW_GIT_REPO_URL, MLFLOW_RUN_NOTE

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_platform.recipe.loader import flatten, recipe_to_yaml
from osdp_platform.recipe.schema import Recipe
from osdp_platform.tracking.keys import (
    DOES_NOT_FIT,
    PLANNED,
    Metric,
    RunKind,
    Tag,
    hardware_label,
    plan_hash,
    plan_metrics,
    plan_params,
    recipe_hash,
)
from osdp_platform.tracking.pending import RUN, WRITES, PendingWrites, Write

MAX_METRICS_PER_BATCH = 1000  # MLflow's limits for one log_batch
MAX_PARAMS_PER_BATCH = 100
PENDING_DIR = "mlflow-pending"  # under the working directory, one folder per run
RETRY_EVERY_S = 2.0
HEALTH_TIMEOUT_S = 2.0
UNREACHABLE = (MlflowException, requests.RequestException, OSError)

log = logging.getLogger(__name__)


def _answers(uri: str) -> bool:
    """Whether the tracking server is up; stores that are not servers always count as up."""
    if not uri.startswith(("http://", "https://")):
        return True
    try:
        return requests.get(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).ok
    except requests.RequestException:
        return False


def check_store(uri: str, option: str = "tracking.uri") -> None:
    """Refuse a store MLflow itself would refuse when the run opens (`validate` checks this much); `option`
    names where the URI came from (`compare --uri`)."""
    if urlparse(uri).scheme in ("", "file") and not MLFLOW_ALLOW_FILE_STORE.get():
        raise UserError(
            option,
            uri,
            "MLflow opens a folder store (file:// or a path) only with MLFLOW_ALLOW_FILE_STORE=true",
            "use a database such as sqlite:///mlflow.db (`mlflow migrate-filestore` moves an existing folder's runs), "
            "or set MLFLOW_ALLOW_FILE_STORE=true",
        )


def check_reachable(uri: str, option: str = "tracking.uri") -> None:
    """Refuse before anything starts a store MLflow would refuse or a server that does not answer; later,
    writes wait instead."""
    check_store(uri, option)
    if uri.startswith(("http://", "https://")):
        # MLflow's default retries a dead server for minutes per request; waiting writes make that needless
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    if not _answers(uri):
        raise UserError(
            option,
            uri,
            "the MLflow tracking server does not answer",
            f"start it (mlflow server ...), or leave {option} unset for a local sqlite file",
        )


def _local_store_path(uri: str) -> Path | None:
    """The file or folder a local store keeps its runs in (None for a server or an in-memory database)."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        path = uri.removeprefix("sqlite:///").split("?", 1)[0]
        return Path(path) if uri.startswith("sqlite:///") and path not in ("", ":memory:") else None
    if parsed.scheme in ("", "file"):
        return Path(parsed.path)
    return None


def check_readable(uri: str, option: str = "tracking.uri") -> None:
    """What check_reachable refuses, and a local store that does not exist: MLflow would create an empty one,
    and reading runs must write nothing."""
    check_reachable(uri, option)
    path = _local_store_path(uri)
    if path is not None and not path.exists():
        raise UserError(
            option,
            uri,
            f"no tracking store at {path.resolve()}",
            f"pass the store the runs were recorded in (the recipe's tracking.uri; default sqlite:///mlflow.db in "
            f"the folder submit ran in) as {option}",
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
        if not (folder / RUN).is_file():  # checked here: a missing folder would otherwise surface as an OSError
            raise UserError(
                "FOLDER",
                str(folder),
                f"holds no {RUN}: sync expects the folder a run kept its MLflow writes in (mlflow-pending/<run id>, "
                f"with {RUN} and {WRITES}), and removes it once they are uploaded",
                "pass the folder the run's warning named (`osdp-platform sync FOLDER`); if sync already said "
                "`uploaded`, there is nothing left to do",
            )
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
