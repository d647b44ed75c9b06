"""A fault inside Ray reaches the CLI as its innermost cause (platform/osdp_platform/driver/faults.py)."""

import pytest
import ray
from ray.train import ControllerError, WorkerGroupError

from osdp_planners.errors import NoPlanFits, UserError
from osdp_platform.driver.faults import one_line, root_cause


@ray.remote
def _plan_remotely() -> None:
    raise NoPlanFits("hardware.memory_per_device_gb", 0.001, "no plan fits", "raise it", 0.004)


def test_a_user_error_raised_in_a_ray_task_arrives_whole(ray_cluster: None) -> None:
    """A real task's exception, as the planner actor's reaches the driver: RayTaskError around it."""
    with pytest.raises(Exception) as info:
        ray.get(_plan_remotely.remote())
    cause = root_cause(info.value)
    assert isinstance(cause, NoPlanFits) and isinstance(cause, UserError)
    assert cause.advised_gb == 0.004 and cause.field == "hardware.memory_per_device_gb"


def test_the_lowest_ranks_failure_is_the_cause_and_prints_as_one_line() -> None:
    failures: dict[int, Exception] = {3: ValueError("later"), 1: RuntimeError("gloo\n  connection reset\n\n by peer")}
    cause = root_cause(ControllerError(WorkerGroupError("2 workers failed", failures)))
    assert cause is failures[1]
    assert one_line(cause) == "RuntimeError: gloo connection reset by peer"
