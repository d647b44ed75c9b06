"""MLflow over HTTP against a real `mlflow server`: a submit that outlives its server going away, a plan
recorded without training, writes kept on disk and synced later, and the UI on a local store."""

import io
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from mlflow.tracking import MlflowClient
from rich.console import Console

from helpers import CLI, RECIPES, MlflowServer, free_port
from osdp_planners.plan import Plan
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.driver.submit import submit
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.worker import train_loop
from osdp_platform.tracking.keys import RunKind
from osdp_platform.tracking.runs import PENDING_DIR, RunTracker

pytestmark = pytest.mark.heavy

STEPS = 12
STEP_PAUSE_S = 0.7  # each step takes at least this long, so its stamp shows when it ran
CHART_ARTIFACTS = {"plan_units.md", "memory.png", "strategies.png", "step_time.png"}


@dataclass(frozen=True)
class SlowSteps:
    """Train loop wrapper: every step waits a little first, so the run outlasts the server's absence."""

    seconds: float

    def __call__(self, config: dict[str, Any]) -> None:
        train_loop(config, before_step=lambda _step: time.sleep(self.seconds))


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _logged_steps(client: MlflowClient, experiment: str) -> int:
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id]) if found else []
    return len(client.get_metric_history(runs[0].info.run_id, "loss")) if runs else 0


def _server_goes_away_mid_run(server: MlflowServer, experiment: str, pending: Path) -> None:
    """Stop the server once two steps are in MLflow; start it again once the run keeps writes on disk."""
    client = MlflowClient(server.uri)
    _wait_for(lambda: _logged_steps(client, experiment) >= 2, 600, "the first steps in MLflow")
    server.stop()
    try:
        _wait_for(lambda: any(pending.glob("*/writes.jsonl")), 300, "writes kept on disk")
    finally:
        server.start()


def _baselines_beside_the_plan(client: MlflowClient, run_id: str, plan: Plan) -> None:
    """OSDP's prediction and every uniform plan's are metrics in one unit at one step: one MLflow chart."""
    metrics = client.get_run(run_id).data.metrics
    assert metrics["predicted_throughput_samples_per_s"] == pytest.approx(plan.predicted.throughput_samples_per_s)
    assert set(plan.baselines) == {"ddp", "zero2", "zero3", "hsdp"}
    assert any(b.fits for b in plan.baselines.values())
    for name, b in plan.baselines.items():
        assert metrics[f"baseline_{name}_fits"] == float(b.fits)
        if b.fits:
            assert metrics[f"baseline_{name}_throughput_samples_per_s"] == pytest.approx(b.throughput_samples_per_s)
            assert metrics[f"baseline_{name}_peak_memory_bytes"] == b.peak_memory_bytes
        else:
            assert f"baseline_{name}_throughput_samples_per_s" not in metrics
    fitting = [f"baseline_{n}_throughput_samples_per_s" for n, b in plan.baselines.items() if b.fits]
    for key in ["predicted_throughput_samples_per_s", *fitting]:
        assert [m.step for m in client.get_metric_history(run_id, key)] == [0], key


def test_submit_over_http_outlives_the_server_going_away(
    ray_cluster: None, mlflow_server: MlflowServer, workdir: Path
) -> None:
    experiment = "tracking-http"
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        [f"train.steps={STEPS}", f"tracking.uri={mlflow_server.uri}", f"tracking.experiment={experiment}"],
    )
    pending = workdir / PENDING_DIR
    away = threading.Thread(target=_server_goes_away_mid_run, args=(mlflow_server, experiment, pending))
    away.start()
    out = io.StringIO()
    summary = submit(recipe, console=Console(file=out, width=400), train_fn=SlowSteps(STEP_PAUSE_S))
    away.join(timeout=600)
    printed = out.getvalue()

    assert "does not answer" in printed and str(pending / summary.run_id) in printed, printed
    assert "is back" in printed, printed
    assert not pending.exists()  # every kept write was uploaded
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(summary.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(STEPS))
    assert [m.value for m in history] == pytest.approx([s["loss"] for s in summary.steps])
    gaps = [b.timestamp - a.timestamp for a, b in itertools.pairwise(history)]
    assert min(gaps) >= 1000 * STEP_PAUSE_S * 0.9, gaps  # each step's own end, not the time of a batched write
    artifacts = {a.path for a in client.list_artifacts(summary.run_id)}
    assert {"plan.json", "recipe.yaml", "profile.json"} | CHART_ARTIFACTS <= artifacts
    metrics = run.data.metrics
    assert metrics["peak_memory_ratio"] == pytest.approx(
        metrics["measured_peak_memory_bytes"] / metrics["predicted_peak_memory_bytes"]
    )
    assert any(k.startswith("system/") and k.endswith("/cpu_utilization_percentage") for k in metrics), metrics
    _baselines_beside_the_plan(client, summary.run_id, summary.plan)
    tags, params, plan = run.data.tags, run.data.params, summary.plan
    assert (tags["run_kind"], tags["planner"], tags["model"], tags["hardware"]) == (
        "train",
        "osdp",
        "llama-tiny",
        "1x2 cpu",
    )
    assert len(tags["recipe_hash"]) == 16 and len(tags["plan_hash"]) == 16
    assert params["plan.micro_batch_size"] == str(plan.micro_batch_size)
    per_strategy = Counter(
        f"hsdp_g{u.shard_group_size}" if u.strategy.value == "hsdp" else u.strategy.value for u in plan.units
    )
    assert {k: params[f"plan.units.{k}"] for k in per_strategy} == {k: str(v) for k, v in per_strategy.items()}
    assert params["plan.units.checkpointed"] == str(sum(u.checkpoint for u in plan.units))


def test_writes_wait_on_disk_while_the_server_is_away_and_sync_uploads_them(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        [f"tracking.uri={mlflow_server.uri}", "tracking.experiment=offline", "tracking.wait_for_server_s=0"],
    )  # the server is back only later
    warnings: list[str] = []
    tracker = RunTracker.start(recipe, RunKind.TRAIN, warn=warnings.append)
    tracker.pending_root = tmp_path / "pending"
    folder = tracker.pending_root / tracker.run_id
    t0 = 1_700_000_000_000
    tracker.log_samples([(0, t0, {"loss": 3.0}), (1, t0 + 1000, {"loss": 2.5})])
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"not really a png")
    mlflow_server.stop()
    try:
        tracker.log_samples([(2, t0 + 2000, {"loss": 2.0})])
        tracker.record_checkpoint(3, "/ckpt/3")
        tracker.log_file(chart)
        chart.unlink()  # the caller's copy may be temporary: the kept copy must do
        tracker.log_text("kept", "notes.txt")
        tracker.finish()
        assert any("does not answer" in w and str(folder) in w for w in warnings), warnings
        assert f"osdp-platform sync {folder}" in warnings[-1]
        assert (folder / "writes.jsonl").is_file()
    finally:
        mlflow_server.start()
    assert main(["sync", str(folder)]) == 0
    assert not folder.exists()
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    history = sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(tracker.run_id, "loss"))
    assert history == [(0, 3.0, t0), (1, 2.5, t0 + 1000), (2, 2.0, t0 + 2000)]
    assert (run.data.tags["checkpoint_path"], run.data.tags["checkpoint_step"]) == ("/ckpt/3", "3")
    local = Path(client.download_artifacts(tracker.run_id, "", str(tmp_path / "back")))
    assert (local / "chart.png").read_bytes() == b"not really a png"
    assert (local / "notes.txt").read_text() == "kept"


def test_plan_track_records_a_plan_run_with_its_baselines(
    mlflow_server: MlflowServer, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = RECIPES.parent
    monkeypatch.chdir(repo)  # the git commit is the working directory's
    overrides = [f"tracking.uri={mlflow_server.uri}", "tracking.experiment=plans"]
    before = sorted(p.name for p in repo.iterdir())
    assert main(["plan", str(RECIPES / "tiny.yaml"), *overrides, "--track"]) == 0
    out = capsys.readouterr().out
    run_id = out.split("plan recorded as MLflow run ")[1].split()[0]
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert (run.data.tags["run_kind"], run.data.tags["plan_status"], run.info.status) == ("plan", "planned", "FINISHED")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode == 0:
        assert run.data.tags["mlflow.source.git.commit"] == head.stdout.strip()
    assert {"plan.json", "recipe.yaml"} | CHART_ARTIFACTS <= {a.path for a in client.list_artifacts(run_id)}
    assert not any(k.startswith("measured_") for k in run.data.metrics)
    plan = Plan.from_file(client.download_artifacts(run_id, "plan.json", str(workdir)))
    _baselines_beside_the_plan(client, run_id, plan)
    assert sorted(p.name for p in repo.iterdir()) == before  # nothing written where it ran


def test_the_explanation_the_charts_draw_adds_up_to_the_prediction() -> None:
    result = plan_recipe(load_recipe(RECIPES / "tiny.yaml"))
    parts, plan = result.explanation, result.plan
    assert set(parts.units) == {u.name for u in plan.units}
    seconds = [(u.compute_s, u.communication_s, u.optimizer_s) for u in parts.units.values()]
    assert all(min(unit) >= 0 for unit in seconds)
    assert all(sum(unit[i] for unit in seconds) > 0 for i in range(3))  # compute, comm, optimizer
    assert parts.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert [parts.units[u.name].total_s for u in plan.units] == [u.predicted_time_s for u in plan.units]
    assert int(parts.peak_bytes) == plan.predicted.peak_memory_bytes
    assert {"profile", "measured_compute", "measured_comm", "device"} <= set(json.loads(parts.computed_from))


def test_ui_serves_the_local_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = RunTracker.create(uri, "ui-check", "seen-in-the-ui", {})
    tracker.finish()
    port = free_port()
    ui = subprocess.Popen(
        [CLI, "ui", "--uri", uri, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for(lambda: _answers(f"http://127.0.0.1:{port}"), 180, "the UI")
        run = MlflowClient(f"http://127.0.0.1:{port}").get_run(tracker.run_id)
        assert run.info.run_name == "seen-in-the-ui"
        started = [" ".join(p.cmdline()) for p in psutil.Process(ui.pid).children(recursive=True)]
        assert not [c for c in started if "huey" in c or "_job_runner" in c], started  # no job runners
    finally:
        os.killpg(ui.pid, signal.SIGKILL)
        ui.wait(timeout=60)


def _answers(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).ok
    except requests.RequestException:
        return False


def test_an_unreachable_server_is_a_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["compare", "--uri", dead, "--experiment", "x"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"--uri = '{dead}'" in err and "does not answer" in err and "Traceback" not in err
    assert "tracking.uri" not in err  # named as the option given, with its own fix


def test_a_folder_store_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set: validate and submit say so before
    Ray starts; with the variable set, validate passes it."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "mlruns"
    for command in ("validate", "submit"):
        code = main([command, str(RECIPES / "tiny.yaml"), f"tracking.uri=file://{store}"])
        err = capsys.readouterr().err
        assert code == EXIT_USER_ERROR, err
        assert f"tracking.uri = 'file://{store}'" in err and "MLFLOW_ALLOW_FILE_STORE=true" in err and "sqlite" in err
    assert not store.exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert main(["validate", str(RECIPES / "tiny.yaml"), f"tracking.uri=file://{store}"]) == 0
