"""Connect to Ray (in-process local, or the cluster at RAY_ADDRESS) and check it can host the pool."""

import logging
import os

import ray
import torch

from osdp_planners.errors import UserError
from osdp_platform.recipe import Recipe


def check_local_devices(recipe: Recipe, address: str | None) -> None:
    """Fail before Ray starts when a local run asks for GPUs this machine does not have."""
    hw = recipe.hardware
    if address or hw.accelerator != "gpu" or hw.autoscaling:
        return
    present = torch.cuda.device_count()
    if present < hw.world_size:
        raise UserError(
            "hardware.accelerator", "gpu",
            f"the pool needs {hw.world_size} GPUs ({hw.nodes} node(s) x {hw.workers_per_node}) but this machine "
            f"has {present}",
            "set hardware.accelerator=cpu hardware.preset=cpu, or submit to a GPU cluster with --address",
        )


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
    cpus = max(os.cpu_count() or 1, recipe.hardware.world_size)
    # "local": a new Ray of our own, never a cluster another `ray start` on this machine left behind
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=verbose,
             logging_level=level)


def check_cluster(recipe: Recipe) -> None:
    """Fail fast, never wait forever, when the cluster lacks the devices the pool declares."""
    hw = recipe.hardware
    if hw.autoscaling:
        return
    resources = ray.cluster_resources()
    kind = "GPU" if hw.accelerator == "gpu" else "CPU"
    have = int(resources.get(kind, 0))
    if have < hw.world_size:
        raise UserError(
            "hardware.workers_per_node", hw.workers_per_node,
            f"the pool needs {hw.world_size} {kind} worker(s) but the Ray cluster has {have} {kind}(s)",
            "lower hardware.nodes / hardware.workers_per_node, add nodes, or set hardware.autoscaling=true on "
            "an autoscaling cluster",
        )
