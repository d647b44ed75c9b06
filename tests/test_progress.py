"""Rank 0 -> driver on a real local Ray and a real MLflow store: every step arrives, in order, and the
inbox keeps the newest checkpoint for a restart (Ray Train may not have registered it yet)."""

import threading
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

from osdp_platform.checkpoint import CHECKPOINT_PATH_TAG, CHECKPOINT_STEP_TAG, CheckpointSaved
from osdp_platform.progress import MetricsInbox, MetricsPump, MetricsSender
from osdp_platform.tracking import RunTracker

STEPS = 7
CHECKPOINT_AFTER = (2, 5)  # steps after which a checkpoint is stored


@ray.remote(num_cpus=0)
def _rank0(inbox: object) -> None:
    """What the worker loop's rank 0 does, in another process: send each step, then each checkpoint."""
    sender = MetricsSender(inbox)
    for step in range(STEPS):
        sender.send((step, {"loss": 10.0 - step, "step_time_s": 0.01}))
        if step in CHECKPOINT_AFTER:
            sender.send(CheckpointSaved(step + 1, f"/ckpt/{step + 1}"))
    sender.close()


def test_every_step_reaches_mlflow_and_the_inbox_keeps_the_newest_checkpoint(
        ray_cluster: None, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("progress"))
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
    assert sorted((m.step, m.value) for m in history) == [(s, 10.0 - s) for s in range(STEPS)]
    tags = client.get_run(run.info.run_id).data.tags
    newest = CHECKPOINT_AFTER[-1] + 1
    assert tags[CHECKPOINT_STEP_TAG] == str(newest) and tags[CHECKPOINT_PATH_TAG] == f"/ckpt/{newest}"
    assert ray.get(inbox.latest_checkpoint.remote()) == CheckpointSaved(newest, f"/ckpt/{newest}")


def test_an_empty_inbox_has_no_checkpoint(ray_cluster: None) -> None:
    inbox = MetricsInbox.remote()  # type: ignore[attr-defined]
    assert ray.get(inbox.latest_checkpoint.remote()) is None
    assert ray.get(inbox.drain.remote()) == []
