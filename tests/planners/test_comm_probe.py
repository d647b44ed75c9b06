"""The collectives' probe runs at any world size a pool may have, not only those that divide its buffer."""

from osdp_planners.comm_probe import bandwidths
from osdp_planners.local_ranks import run_ranks


def bandwidth_rank(_rank: int, world: int, _args: list[str]) -> dict[str, float]:
    """A rank of the probe's bandwidth part alone (run_ranks imports this module in each rank)."""
    return bandwidths(world)


def test_bandwidths_are_measured_on_three_ranks() -> None:
    """A megabyte-sized buffer does not split in 3 equal parts: the probe failed for 3 workers per node."""
    measured = run_ranks(f"{__name__}:bandwidth_rank", 3, [])
    assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(v > 0 for v in measured.values()), measured
