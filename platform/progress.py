"""Per-step metrics and stored checkpoints from rank 0 to the driver, through an inbox actor.

On a CPU pool the driver, the inbox and the workers share cores, and every message wakes a process
that preempts a rank (its peers then wait at the next collective). So rank 0 pushes without waiting
for an answer, the driver collects everything pending in one call per POLL_S, and MLflow is written
every FLUSH_EVERY_S. A step's metrics leave rank 0 as the step ends, so a later failure of any
worker does not lose them. The inbox outlives the workers, so it also keeps the newest stored
checkpoint for a restart after a failure (see checkpoint.py).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from osdp_platform.checkpoint import CHECKPOINT_PATH_TAG, CHECKPOINT_STEP_TAG, CheckpointSaved
from osdp_platform.tracking import RunTracker

POLL_S = 0.5
FLUSH_EVERY_S = 5.0

Message = tuple[int, dict[str, float]] | CheckpointSaved


@ray.remote(num_cpus=0)
class MetricsInbox:
    """Holds messages until the driver drains them; calls from one sender run in the order sent."""

    def __init__(self) -> None:
        self.pending: list[Message] = []
        self.checkpoint: CheckpointSaved | None = None

    def push(self, message: Message) -> None:
        self.pending.append(message)
        if isinstance(message, CheckpointSaved):
            self.checkpoint = message

    def latest_checkpoint(self) -> CheckpointSaved | None:
        return self.checkpoint

    def drain(self) -> list[Message]:
        out, self.pending = self.pending, []
        return out


class MetricsSender:
    """Rank 0's side: a step's metrics are sent at once but not waited for (a step costs no round
    trip); a checkpoint is waited for, so it is on record before training goes on."""

    def __init__(self, inbox: Any) -> None:
        self.inbox = inbox
        self.last: Any = None

    def send(self, message: Message) -> None:
        self.last = self.inbox.push.remote(message)
        if isinstance(message, CheckpointSaved):
            ray.get(self.last)

    def close(self) -> None:
        """Wait until the last push arrived (earlier ones arrived before it): the process may end next."""
        if self.last is not None:
            ray.get(self.last)


@dataclass
class MetricsPump:
    """The driver's side: moves messages to MLflow (batched) and to `on_metrics` until `done` is set."""

    inbox: Any
    tracker: RunTracker
    on_metrics: Callable[[int, dict[str, float]], None]  # each step's metrics as they arrive

    def run(self, done: threading.Event) -> None:
        pending: list[tuple[int, dict[str, float]]] = []
        flushed = time.monotonic()
        while True:
            finished = done.is_set()  # read before draining: what was pushed before the end is drained
            for message in ray.get(self.inbox.drain.remote()):
                if isinstance(message, CheckpointSaved):  # its metrics first: tags never run ahead of them
                    self.tracker.log_steps(pending)
                    pending.clear()
                    self.tracker.client.set_tag(self.tracker.run_id, CHECKPOINT_PATH_TAG, message.path)
                    self.tracker.client.set_tag(self.tracker.run_id, CHECKPOINT_STEP_TAG, str(message.step))
                else:
                    self.on_metrics(*message)
                    pending.append(message)
            if finished:
                break
            if pending and time.monotonic() - flushed > FLUSH_EVERY_S:
                self.tracker.log_steps(pending)
                pending.clear()
                flushed = time.monotonic()
            done.wait(POLL_S)
        self.tracker.log_steps(pending)
