"""Connect to Ray (in-process local, or the cluster at RAY_ADDRESS) and check it can host the pool.

The pool is also asked for by name: every worker and the planner actor take one unit of the recipe's
pool resource (`hardware.pool`), so a plan made for A100s runs on the nodes that advertise A100s,
and an autoscaler grows the group that provides them.
"""

import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from osdp_planners.errors import UserError
from osdp_platform.recipe.schema import HardwareSection, Recipe


def pool_request(hw: HardwareSection) -> dict[str, float]:
    """The custom resource one worker (or the planner actor) takes: one unit of the pool, or nothing."""
    return {hw.pool_resource: 1.0} if hw.pool_resource else {}


def beside_the_driver() -> NodeAffinitySchedulingStrategy:
    """Where the driver's helper actors go: a 0-CPU actor on a worker node holds no resource, so an
    autoscaler sees that node as idle and removes it, actor and all."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def connect(recipe: Recipe, address: str | None, verbose: bool = True) -> None:
    """Start a local Ray without dashboard, or join the cluster at `address`/RAY_ADDRESS.

    Not `verbose`: Ray's own logs and the workers' output stay in Ray's log files (errors still arrive
    as exceptions), so the terminal shows the platform's progress and nothing else.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    level = logging.INFO if verbose else logging.ERROR  # INFO: Ray's default
    if address:
        ray.init(address=address, log_to_driver=verbose, logging_level=level)
        return
    hw = recipe.hardware
    cpus = max(os.cpu_count() or 1, hw.world_size)
    # A local run is its own pool: this machine advertises the pool resource for every worker.
    pool = {name: float(hw.world_size) for name in pool_request(hw)}
    # "local": a new Ray of our own, never a cluster another `ray start` on this machine left behind
    ray.init(
        address="local",
        num_cpus=cpus,
        resources=pool,
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=level,
    )


def check_cluster(recipe: Recipe) -> None:
    """Fail fast, never wait forever, when the cluster lacks the devices the pool declares."""
    hw = recipe.hardware
    if hw.autoscaling or hw.elastic:  # an elastic pool waits for hardware.min_nodes (driver/elastic.py)
        return
    resources = ray.cluster_resources()
    pool = hw.pool_resource
    if pool is not None and resources.get(pool, 0) < hw.world_size:
        raise UserError(
            "hardware.pool",
            hw.pool,
            f"every worker takes one unit of the Ray resource {pool!r}, {hw.world_size} in all, but the cluster's "
            f"nodes advertise {resources.get(pool, 0):g}",
            f"start the pool's nodes with --resources='{{\"{pool}\": <devices per node>}}' (KubeRay: the worker "
            "group's `resources`), set hardware.autoscaling=true on a cluster whose autoscaler provides it, or set "
            "hardware.pool=any to run on any node",
        )
    kind = "GPU" if hw.accelerator == "gpu" else "CPU"
    have = int(resources.get(kind, 0))
    if have < hw.world_size:
        raise UserError(
            "hardware.workers_per_node",
            hw.workers_per_node,
            f"the pool needs {hw.world_size} {kind} worker(s) but the Ray cluster has {have} {kind}(s)",
            "lower hardware.nodes / hardware.workers_per_node, add nodes, or set hardware.autoscaling=true on "
            "an autoscaling cluster",
        )
