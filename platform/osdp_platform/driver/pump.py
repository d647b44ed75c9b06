"""The driver's side of the inbox (runtime/inbox.py): drain it every POLL_S, hand each step to the progress bar,
and write MLflow in batches every FLUSH_EVERY_S. What reaches MLflow, and how, is the tracker's business
(tracking/runs.py)."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from osdp_platform.runtime.inbox import CheckpointSaved, NodeSample, WorkersStarted
from osdp_platform.runtime.placement import split_warning
from osdp_platform.tracking.keys import Tag, system_metric
from osdp_platform.tracking.runs import RunTracker

POLL_S = 0.5
FLUSH_EVERY_S = 5.0


@dataclass
class MetricsPump:
    """The driver's side: moves messages to MLflow (batched) and to `on_metrics` until `done` is set."""

    inbox: Any
    tracker: RunTracker
    on_metrics: Callable[[int, dict[str, float]], None]  # each step's metrics as they arrive

    def run(self, done: threading.Event) -> None:
        pending: list[tuple[int, int, dict[str, float]]] = []
        flushed = time.monotonic()
        starts = 0
        while True:
            finished = done.is_set()  # read before draining: what was pushed before the end is drained
            for message in ray.get(self.inbox.drain.remote()):
                if isinstance(message, CheckpointSaved):  # its metrics first: tags never run ahead of them
                    self.tracker.log_samples(pending)
                    pending.clear()
                    self.tracker.record_checkpoint(message.step, message.path)
                elif isinstance(message, WorkersStarted):
                    if split := split_warning(list(message.machines), message.workers_per_node):
                        self.tracker.set_tags({Tag.SPLIT_PLAN_NODES: split})
                        self.tracker.warn(split)
                    starts += 1
                    if starts > 1:
                        self.tracker.log_samples(pending)
                        pending.clear()
                        self.tracker.record_restart(starts - 1, message.step)
                elif isinstance(message, NodeSample):
                    named = {system_metric(message.node, k): v for k, v in message.metrics.items()}
                    pending.append((message.index, message.time_ms, named))
                else:
                    self.on_metrics(message.step, message.metrics)
                    pending.append((message.step, message.ended_ms, message.metrics))
            if finished:
                break
            if pending and time.monotonic() - flushed > FLUSH_EVERY_S:
                self.tracker.log_samples(pending)
                pending.clear()
                flushed = time.monotonic()
            done.wait(POLL_S)
        self.tracker.log_samples(pending)
