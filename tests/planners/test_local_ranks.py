"""A probe's rank that fails says why, in the error that reaches the user."""

import pickle

import pytest

from osdp_planners.errors import UserError
from osdp_planners.local_ranks import run_ranks


def failing_rank(rank: int, _world: int, _args: list[str]) -> dict[str, float]:
    """Rank 1 fails the way a probe's collective does; rank 0 would have answered."""
    if rank == 1:
        raise ValueError("invalid tensor size at index 0 (expected 349525, got 349526)")
    return {"rank": float(rank)}


def test_a_failed_rank_names_its_error() -> None:
    with pytest.raises(UserError) as failed:
        run_ranks(f"{__name__}:failing_rank", 2, [])
    error = pickle.loads(pickle.dumps(failed.value))  # as it crosses Ray from the planner actor
    assert error.field == "hardware.workers_per_node" and error.value == 2
    assert "failed (exit codes [" in error.problem and "fix:" in str(error)
    assert "ValueError: invalid tensor size at index 0 (expected 349525, got 349526)" in error.problem
