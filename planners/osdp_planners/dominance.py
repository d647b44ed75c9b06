"""Options no plan needs: one that another option of its unit beats on time and on memory at every event.

Replacing a dominated option by the one that beats it keeps every event's level (the simulated
peak is a sum of per-unit contributions, memory_model.py) and does not raise the cost, so dropping
it cannot lose the optimum, of the knapsack or of the exact program. At scale most options go: a
compute-bound block prices ZeRO-3 and HSDP alike, and a split costs time without saving memory
where the block's largest gather does not set its peak.
"""

import numpy as np

from osdp_planners.evaluate import Bound
from osdp_planners.options import Option


def undominated(costs: list[float], rows: np.ndarray) -> list[int]:
    """Indices of the options no other one beats: no cheaper-or-equal option holds no more anywhere.
    Of options equal in both, the first is kept."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], float(rows[i].sum()), i))
    kept: list[int] = []
    for i in order:
        if not kept or not np.all(rows[kept] <= rows[i], axis=1).any():
            kept.append(i)
    return sorted(kept)


def prune(
    bound: Bound, units: list[str], options: dict[str, list[Option]], costs: list[list[float]]
) -> list[list[int]]:
    """Per unit, the indices of its options that survive (identical units are compared once)."""
    seen: dict[tuple[object, ...], list[int]] = {}
    out = []
    for u, c in zip(units, costs, strict=True):
        key = (bound.signature(u), tuple(options[u]), tuple(c))
        if key not in seen:
            seen[key] = undominated(c, bound.memory_rows(u, options[u]))
        out.append(seen[key])
    return out
