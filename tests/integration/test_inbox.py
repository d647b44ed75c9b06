"""Rank 0 -> driver on a real local Ray and a real MLflow store: every step arrives, in order and stamped
with the time it ended on rank 0 (not the driver's flush time), node samples arrive under MLflow's
system-metric names, and the inbox keeps the newest checkpoint for a restart (Ray Train may not have
registered it yet)."""

import threading
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

from osdp_platform.driver.pump import MetricsPump
from osdp_platform.runtime.inbox import (
    CheckpointSaved,
    MetricsInbox,
    MetricsSender,
    NodeSample,
    StepReport,
    WorkersStarted,
)
from osdp_platform.tracking.keys import Tag
from osdp_platform.tracking.runs import RunTracker

STEPS = 7
CHECKPOINT_AFTER = (2, 5)  # steps after which a checkpoint is stored
ENDED_MS = 1_700_000_000_000  # step s ended at ENDED_MS + 1000 s


@ray.remote(num_cpus=0)
def _rank0(inbox: object) -> None:
    """What the worker loop's rank 0 does, in another process: send each step, then each checkpoint."""
    sender = MetricsSender(inbox)
    for step in range(STEPS):
        sender.send(StepReport(step, ENDED_MS + 1000 * step, {"loss": 10.0 - step, "step_time_s": 0.01}))
        if step in CHECKPOINT_AFTER:
            sender.send(CheckpointSaved(step + 1, f"/ckpt/{step + 1}"))
    sender.send(NodeSample("10.0.0.7", 0, ENDED_MS, {"cpu_utilization_percentage": 42.0}))
    sender.close()


def test_every_step_reaches_mlflow_and_the_inbox_keeps_the_newest_checkpoint(ray_cluster: None, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("inbox"))
    tracker = RunTracker(uri, run.info.run_id)
    inbox = MetricsInbox.remote()  # type: ignore[attr-defined]
    seen: list[int] = []
    done = threading.Event()
    pump = threading.Thread(target=MetricsPump(inbox, tracker, lambda step, _m: seen.append(step)).run, args=(done,))
    pump.start()
    ray.get(_rank0.remote(inbox))
    done.set()
    pump.join(timeout=60)

    assert not pump.is_alive()
    assert seen == list(range(STEPS))
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [
        (s, 10.0 - s, ENDED_MS + 1000 * s) for s in range(STEPS)
    ]
    system = client.get_metric_history(run.info.run_id, "system/10.0.0.7/cpu_utilization_percentage")
    assert [(m.step, m.value, m.timestamp) for m in system] == [(0, 42.0, ENDED_MS)]
    tags = client.get_run(run.info.run_id).data.tags
    newest = CHECKPOINT_AFTER[-1] + 1
    assert tags[Tag.CHECKPOINT_STEP] == str(newest) and tags[Tag.CHECKPOINT_PATH] == f"/ckpt/{newest}"
    assert ray.get(inbox.latest_checkpoint.remote()) == CheckpointSaved(newest, f"/ckpt/{newest}")


def test_workers_that_split_a_plan_node_over_two_machines_are_a_warning_and_a_tag(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Rank 0 reports each rank's machine as the workers start; 8 ranks in plan nodes of 4 on machines that
    took 6 and 2 split plan node 1, which the driver prints and tags the run with."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("placement"))
    warnings: list[str] = []
    tracker = RunTracker(uri, run.info.run_id, warn=warnings.append)
    inbox = MetricsInbox.remote()  # type: ignore[attr-defined]
    done = threading.Event()
    pump = threading.Thread(target=MetricsPump(inbox, tracker, lambda _s, _m: None).run, args=(done,))
    pump.start()
    sender = MetricsSender(inbox)
    sender.send(WorkersStarted(0, 8, (0,) * 6 + (1,) * 2, 4))
    sender.close()
    done.set()
    pump.join(timeout=60)
    assert len(warnings) == 1 and warnings[0].startswith("plan node 1 (ranks 4-7) on machines 0, 1"), warnings
    assert client.get_run(run.info.run_id).data.tags[Tag.SPLIT_PLAN_NODES] == warnings[0]


def test_an_empty_inbox_has_no_checkpoint(ray_cluster: None) -> None:
    inbox = MetricsInbox.remote()  # type: ignore[attr-defined]
    assert ray.get(inbox.latest_checkpoint.remote()) is None
    assert ray.get(inbox.drain.remote()) == []
