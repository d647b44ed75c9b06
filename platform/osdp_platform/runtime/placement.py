"""Where the plan's nodes landed: the ranks of each plan node should share one machine.

The plan puts `workers_per_node` consecutive ranks on each node and prices the traffic of groups inside
a node at the node's links. Ray Train numbers the workers machine by machine, but places them by its own
strategy: on machines that host more workers than a plan node holds, and not a multiple of it (8 workers
in plan nodes of 4 on machines of 6 and 4), a plan node can land on two machines and its traffic crosses
the slower network unpriced. The driver refuses pools whose machines are too small for a plan node
(driver/cluster.py); this finds the rest once the workers run, so that the run says so.
"""

import torch.distributed as dist

NAMED = 4  # split plan nodes a warning names one by one (it is also a tag, whose length MLflow limits)


def _machines_of(node: int, machines: list[int], workers_per_node: int) -> set[int]:
    """The machines plan node `node` (ranks node * workers_per_node onwards) runs on."""
    return set(machines[node * workers_per_node : (node + 1) * workers_per_node])


def split_plan_nodes(machines: list[int], workers_per_node: int) -> list[int]:
    """The plan nodes (rank // workers_per_node) whose ranks run on more than one machine (`machines`: the
    machine of each rank)."""
    nodes = range(len(machines) // workers_per_node)
    return [n for n in nodes if len(_machines_of(n, machines, workers_per_node)) > 1]


def machine_of_each_rank(node_id: str) -> list[int]:
    """Every rank's machine, numbered in rank order, from each rank's Ray node id: the unit Ray places
    workers on and the driver's pool check counts (Ray Train's node rank numbers IP addresses, which
    several Ray nodes of one host share). A collective: every rank calls it."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, node_id)
    numbers: dict[str | None, int] = {}
    return [numbers.setdefault(n, len(numbers)) for n in gathered]


def split_warning(machines: list[int], workers_per_node: int) -> str | None:
    """What the run says when plan nodes landed on more than one machine; None when none did."""
    split = split_plan_nodes(machines, workers_per_node)
    if not split:
        return None
    where = "; ".join(
        f"plan node {n} (ranks {n * workers_per_node}-{(n + 1) * workers_per_node - 1}) on machines "
        + ", ".join(str(m) for m in sorted(_machines_of(n, machines, workers_per_node)))
        for n in split[:NAMED]
    ) + (f" and {len(split) - NAMED} more plan nodes" if len(split) > NAMED else "")
    return (
        f"{where}: the plan priced their traffic at a node's links, and it crosses the network; for the plan's "
        f"times, give each machine a multiple of hardware.workers_per_node ({workers_per_node}) workers"
    )
