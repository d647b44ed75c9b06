"""Connect to Ray (in-process local, or the cluster at RAY_ADDRESS) and check it can host the pool.

The pool is also asked for by name: every worker and the planner actor take one unit of the recipe's
pool resource (`hardware.pool`), so a plan made for A100s runs on the nodes that advertise A100s,
and an autoscaler grows the group that provides them.
"""

import logging
import os
import socket
import warnings
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from osdp_planners.errors import UserError
from osdp_platform.recipe.schema import HardwareSection, Recipe

RAY_CLIENT_SCHEME = "ray://"
PROBE_TIMEOUT_S = 10.0  # a TCP connect to a ray:// or HOST:PORT address: a head across a slow link answers within it
PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy", "GRPC_PROXY", "HTTPS_PROXY", "HTTP_PROXY")


def pool_request(hw: HardwareSection) -> dict[str, float]:
    """The custom resource one worker (or the planner actor) takes: one unit of the pool, or nothing."""
    return {hw.pool_resource: 1.0} if hw.pool_resource else {}


def worker_resources(hw: HardwareSection) -> dict[str, float]:
    """What one worker takes (as submit's ScalingConfig asks for it)."""
    return {"CPU": 1.0, **({"GPU": 1.0} if hw.accelerator == "gpu" else {}), **pool_request(hw)}


def node_totals() -> list[Mapping[str, float]]:
    """Each live node's total resources (what it hosts, the running group's own workers included)."""
    return [n["Resources"] for n in ray.nodes() if n["Alive"]]


def hosted(node_resources: list[Mapping[str, float]], hw: HardwareSection) -> list[int]:
    """How many workers each node can host, from its total resources."""
    need = worker_resources(hw)
    return [min(int(res.get(k, 0.0) // v) for k, v in need.items()) for res in node_resources]


def beside_the_driver() -> NodeAffinitySchedulingStrategy:
    """Where the driver's helper actors go: a 0-CPU actor on a worker node holds no resource, so an
    autoscaler sees that node as idle and removes it, actor and all."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def connect(recipes: Recipe | Sequence[Recipe], address: str | None, verbose: bool = True) -> None:
    """Start a local Ray without dashboard, or join the cluster at `address`/RAY_ADDRESS.

    A local Ray is sized for the largest of `recipes` (a sweep's cells, in whatever order): the session
    is started once and hosts them all. Not `verbose`: Ray's own logs and the workers' output stay in
    Ray's log files (errors still arrive as exceptions), so the terminal shows the platform's progress
    and nothing else.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    level = logging.INFO if verbose else logging.ERROR  # INFO: Ray's default
    if address:
        _join(address, verbose, level)
        return
    pools = [r.hardware for r in ([recipes] if isinstance(recipes, Recipe) else recipes)]
    cpus = max(os.cpu_count() or 1, *(hw.world_size for hw in pools))
    # A local run is its own pool: this machine advertises the pool resource for every worker.
    pool: dict[str, float] = {}
    for hw in pools:
        for name in pool_request(hw):
            pool[name] = max(pool.get(name, 0.0), float(hw.world_size))
    # "local": a new Ray of our own, never a cluster another `ray start` on this machine left behind
    ray.init(
        address="local",
        num_cpus=cpus,
        resources=pool,
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=level,
    )


def _join(address: str, verbose: bool, level: int) -> None:
    """ray.init at `address`; a head that does not answer is the user's to fix (a wrong address, a tunnel
    that is down), so it is refused as --address rather than surfacing as Ray's ConnectionError, or, at a
    HOST:PORT address, as Ray's wait of minutes with nothing on the terminal."""
    client = address.startswith(RAY_CLIENT_SCHEME)
    _probe(address, client)
    with warnings.catch_warnings():
        if not verbose:  # Ray's own hint on a client timeout: the error below says it, with the fix
            warnings.filterwarnings("ignore", "Ray Client connection timed out", UserWarning)
        try:
            ray.init(address=address, log_to_driver=verbose, logging_level=level)
        except ConnectionError as exc:
            if not client:
                raise
            raise _no_head(address, str(exc), client) from None


def _probe(address: str, client: bool) -> None:
    """Refuse at once an address nothing listens on: Ray's client retries one for about 30 s, and joining
    a HOST:PORT (the head's GCS) for minutes. `auto` and an address without a port are left to Ray, and so
    is a client reached only through a proxy (gRPC honours the proxy variables)."""
    parsed = urlparse(address if "://" in address else f"//{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError as exc:  # a port that is no number
        raise _no_head(address, str(exc), client) from None
    if host is None or port is None or (client and any(os.environ.get(v) for v in PROXY_VARIABLES)):
        return
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise _no_head(address, str(exc) or type(exc).__name__, client) from None


def _no_head(address: str, reason: str, client: bool) -> UserError:
    return UserError(
        "--address",
        address,
        f"no Ray {'client server' if client else 'head (its GCS port)'} answers there ({reason})",
        "give the head's Ray client address (ray://HEAD:10001; on Kubernetes `kubectl port-forward "
        "svc/<cluster>-head-svc 10001:10001` and --address ray://127.0.0.1:10001), http://HEAD:8265 for the Jobs "
        "API, HEAD:6379 from inside the cluster, or leave --address and $RAY_ADDRESS unset for a local Ray",
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
    check_nodes_host_the_plan(hosted(node_totals(), hw), hw)


def check_nodes_host_the_plan(hosts: list[int], hw: HardwareSection) -> None:
    """The plan puts workers_per_node ranks on each of `nodes` nodes: its shard groups stay inside a node
    and only the traffic between nodes crosses the slower links. On nodes that each host fewer workers,
    Ray would spread a plan's node over several and the plan would cross those links unpriced."""
    whole = sum(1 for h in hosts if h >= hw.workers_per_node)
    if whole >= hw.nodes:
        return
    most = max(hosts, default=0)
    raise UserError(
        "hardware.workers_per_node",
        hw.workers_per_node,
        f"the plan puts {hw.workers_per_node} workers on each of {hw.nodes} node(s), but {whole} of the cluster's "
        f"nodes can host that many (workers each node can host: {sorted(hosts, reverse=True)})",
        f"set hardware.workers_per_node to the workers a node hosts ({most}) and hardware.nodes to match, or add "
        f"nodes that host {hw.workers_per_node}",
    )
