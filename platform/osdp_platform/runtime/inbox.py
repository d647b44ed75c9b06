"""Per-step metrics, node samples and stored checkpoints reach the driver through an inbox actor.

On a CPU pool the driver, the inbox and the workers share cores, and every message wakes a process that
preempts a rank (its peers then wait at the next collective). So rank 0 pushes without waiting for an
answer, and the driver collects everything pending in one call per poll (driver/pump.py, the driver's half, which
writes MLflow: a worker imports this module, never that one). A step's metrics leave rank 0 as the step
ends, stamped with that time, so a later failure of any worker does not lose them and MLflow shows when each
step ran. The inbox outlives the workers, so it also keeps the newest stored checkpoint for a restart after
a failure (see checkpoint.py), and tells an elastic run's workers when the driver wants the group resized.
The inbox and the node samplers are actors of their own: this module imports no torch, so they start in a
second, not in the five that torch and its checkpoint package take to import.
"""

from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class StepReport:
    """Rank 0 -> driver: one step's metrics, and when it ended (ms since the epoch, rank 0's clock)."""

    step: int
    ended_ms: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class NodeSample:
    """A node's sampler -> driver: CPU, memory and GPU use of one node at one moment (driver/system_metrics.py)."""

    node: str
    index: int
    time_ms: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class CheckpointSaved:
    """Rank 0 -> driver: every rank's files for a checkpoint are in storage at `path`."""

    step: int  # the step training continues at
    path: str


@dataclass(frozen=True)
class WorkersStarted:
    """Rank 0 -> driver: the workers (re)started at `step`; after the first, Ray Train restarted them. The
    machine each rank runs on, for the driver to check the plan's nodes against (runtime/placement.py)."""

    step: int
    world_size: int
    machines: tuple[int, ...] = ()
    workers_per_node: int = 1


Message = StepReport | NodeSample | CheckpointSaved | WorkersStarted


@ray.remote(num_cpus=0)
class MetricsInbox:
    """Holds messages until the driver drains them; calls from one sender run in the order sent."""

    def __init__(self) -> None:
        self.pending: list[Message] = []
        self.checkpoint: CheckpointSaved | None = None
        self.resize = False  # an elastic run's driver saw more nodes: the workers stop at their next checkpoint

    def push(self, message: Message) -> None:
        self.pending.append(message)
        if isinstance(message, CheckpointSaved):
            self.checkpoint = message

    def latest_checkpoint(self) -> CheckpointSaved | None:
        return self.checkpoint

    def request_resize(self, wanted: bool = True) -> None:
        self.resize = wanted

    def resize_requested(self) -> bool:
        return self.resize

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
