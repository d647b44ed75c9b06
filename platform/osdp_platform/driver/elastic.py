"""Elastic runs (hardware.min_nodes..max_nodes): a worker group sized to the nodes there, re-planned at every start.

Why in the driver and not Ray Train's elastic ScalingConfig: an OSDP plan is made for one world size, so
the plan must change before a resized group loads its checkpoint, and the change must reach MLflow.
Ray Train's own resizing restarts the group inside `fit()` with no step in between for the driver,
and counts workers from an autoscaling coordinator that asks the autoscaler for max_workers, so the
pool it sees is what it asked for rather than what is there. Here each group is a fixed-size
`TorchTrainer`: when it fails (a node went away) or stops at a checkpoint because the driver saw more
nodes (`GrowthWatch`), the driver counts the nodes, re-plans for them from the first plan's profile
(no probe: osdp_planners.replan), records the plan as a new version of the same run, and starts the
next group, which applies the plan and then loads the last checkpoint (DCP reshards it). The global
batch and the data order stay: the sampler draws each step's batch from (seed, step) alone.
"""

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.autoscaler.sdk import request_resources

from osdp_planners import PlanResult
from osdp_planners.errors import UserError
from osdp_planners.replan import replan
from osdp_platform.driver.cluster import hosted, node_totals, worker_resources
from osdp_platform.driver.faults import one_line, root_cause
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.pool import HardwareSection
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.models import build_model

POLL_S = 2.0  # how often the driver counts the nodes while a group trains, or while it waits for nodes
SETTLE_S = 6.0  # after a failure: the count must hold this long (the cluster notices a lost node in seconds)
REQUEST_EVERY_S = 1.0  # an autoscaling pool's standing request for max_nodes is sent this often (see below)


def nodes_there(node_resources: list[Mapping[str, float]], hw: HardwareSection) -> int:
    """Pool nodes the cluster's nodes can host: each node's workers in whole plan nodes of workers_per_node
    (a plan node never spans machines: see cluster.check_nodes_host_the_plan), at most max_nodes. Counted on
    the nodes' totals, so the group's own workers count as there."""
    return min(sum(h // hw.workers_per_node for h in hosted(node_resources, hw)), hw.node_counts[-1])


def count_nodes(hw: HardwareSection) -> int:
    return nodes_there(node_totals(), hw)


@contextmanager
def asking_for_max_nodes(hw: HardwareSection) -> Iterator[None]:
    """On an autoscaling cluster (hardware.autoscaling), keep the autoscaler asked for max_nodes while the run
    lasts. A group sized to the nodes there demands nothing more, so without this standing request no node
    would be launched for an elastic run, nor replace one that went; at the end the request is withdrawn
    so the autoscaler may take the nodes away.

    The request is sent again every REQUEST_EVERY_S: a cluster holds one request, the last one sent, and every
    Ray Train group starts Ray Data's autoscaling coordinator, which sends its own (empty, with no
    dataset) every 20 s. Sent once, ours lasted until the first group's coordinator replaced it, and a
    lost node was never replaced."""
    if not (hw.elastic and hw.autoscaling):
        yield
        return
    bundles = [worker_resources(hw)] * (hw.node_counts[-1] * hw.workers_per_node)
    done = threading.Event()

    def keep_asking() -> None:
        while True:
            request_resources(bundles=bundles)
            if done.wait(REQUEST_EVERY_S):
                return

    asker = threading.Thread(target=keep_asking, name="osdp-request-max-nodes", daemon=True)
    asker.start()
    try:
        yield
    finally:
        done.set()
        asker.join()
        request_resources(bundles=[])


def should_grow(current: int, there: int) -> bool:
    """A running group of `current` nodes is stopped at its next checkpoint when more are there."""
    return there > current


def wait_for_nodes(hw: HardwareSection, count: Callable[[], int] | None = None, settle_s: float = 0.0) -> int:
    """The nodes to train on: at least min_nodes, waiting up to wait_for_nodes_s for them; with `settle_s`,
    a count that held that long (after a loss, until the cluster has noticed the node is gone)."""
    count = count or (lambda: count_nodes(hw))
    deadline = time.monotonic() + hw.wait_for_nodes_s
    there, since = count(), time.monotonic()
    while True:
        now = time.monotonic()
        if there >= hw.node_counts[0] and now - since >= settle_s:
            return there
        if now > deadline:
            raise UserError(
                "hardware.min_nodes",
                hw.node_counts[0],
                f"the cluster has {there} node(s) of {hw.workers_per_node} worker(s) for this pool, and no more "
                f"came within {hw.wait_for_nodes_s:g} s (hardware.wait_for_nodes_s)",
                "add nodes to the pool, lower hardware.min_nodes, or give an autoscaler more time with "
                "hardware.wait_for_nodes_s",
            )
        time.sleep(min(POLL_S, max(settle_s, 0.1)))
        again = count()
        if again != there:
            there, since = again, time.monotonic()


class GrowthWatch:
    """While a group of `current` nodes trains, count the nodes; when more are there, ask the workers (through
    the inbox) to stop at their next checkpoint."""

    def __init__(self, hw: HardwareSection, current: int, inbox: Any) -> None:
        self.hw, self.current, self.inbox = hw, current, inbox
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "GrowthWatch":
        ray.get(self.inbox.request_resize.remote(False))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            if should_grow(self.current, count_nodes(self.hw)):
                ray.get(self.inbox.request_resize.remote(True))
                return


@dataclass
class ElasticRun:
    """The driver's loop over worker groups. `start(plan, index)` returns the trainer of group `index` (0 first);
    `on_plan(index, step, result)` records a new plan; `say` prints to the user."""

    recipe: Recipe
    first: PlanResult
    nodes: int
    inbox: Any
    start: Callable[[PlanResult, int], Any]
    on_plan: Callable[[int, int, PlanResult], None]
    say: Callable[[str], None]
    failures: int = 0
    groups: int = 0  # worker groups started
    results: list[PlanResult] = field(default_factory=list)

    def run(self) -> PlanResult:
        """Train to the last step; the plan of the last group."""
        result, hw = self.first, self.recipe.hardware
        self.results.append(result)
        while True:
            with GrowthWatch(hw, self.nodes, self.inbox):
                failure = self._fit(self.start(result, self.groups))
                self.groups += 1
            step = self._step()
            if step >= self.recipe.train.steps:
                return result
            nodes = wait_for_nodes(hw, settle_s=SETTLE_S if failure else 0.0)
            if failure is not None and nodes >= self.nodes:
                self._count(failure)  # a crash, not a node that went: train.max_failures bounds these
            before = result.plan.world_size
            why = f"a worker failed: {one_line(root_cause(failure))[:160]}" if failure else "more nodes came"
            if nodes == self.nodes:  # the same world size: the same plan (a plan is a function of it)
                self.say(f"world size {before} again at step {step} ({why}): plan v{len(self.results)} stays")
                continue
            self.nodes = nodes
            result = self.replan(nodes)
            self.results.append(result)
            self.on_plan(len(self.results), step, result)
            self.say(
                f"world size {before} -> {result.plan.world_size} at step {step} ({why}): re-planned without a new "
                f"probe, plan v{len(self.results)}: {describe(result)}"
            )

    def _fit(self, trainer: Any) -> Exception | None:
        """Run one group; None when it ended (done, or stopped to grow), else what failed."""
        try:
            trainer.fit()
        except Exception as exc:
            cause = root_cause(exc)
            if isinstance(cause, UserError):
                raise cause from None
            return exc
        return None

    def _count(self, failure: Exception) -> None:
        self.failures += 1
        limit = self.recipe.train.max_failures
        if 0 <= limit < self.failures:
            raise failure

    def _step(self) -> int:
        """The step the next group continues at: the last stored checkpoint's (0: none yet)."""
        saved = ray.get(self.inbox.latest_checkpoint.remote())
        return saved.step if saved is not None else 0

    def replan(self, nodes: int) -> PlanResult:
        """The plan for `nodes` nodes, from the first plan's profile and measurements (no probe)."""
        recipe = self.recipe.at_nodes(nodes)
        return replan(lambda dev: build_model(recipe.model, dev), self.first, plan_request(recipe))


def describe(result: PlanResult) -> str:
    plan, mib = result.plan, 1024**2
    text = f"micro {plan.micro_batch_size} x accum {plan.grad_accum_steps} x {plan.world_size} worker(s)"
    if plan.predicted.step_time_s:
        text += f", predicted {plan.predicted.step_time_s:.4f} s/step"
    if plan.predicted.peak_memory_bytes:
        text += f", peak {plan.predicted.peak_memory_bytes / mib:.1f} MiB"
    return text
