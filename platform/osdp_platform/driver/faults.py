"""What failed, under Ray's wrappers: the error a worker, the planner actor or Ray Train raised.

A fault inside Ray reaches the driver wrapped (RayTaskError around the actor's exception, Ray
Train's WorkerGroupError holding each rank's, ControllerError around the controller's), and its
printed form is a traceback of every layer. The CLI prints the innermost cause as one message: a
user's mistake raised remotely (a UserError survives pickling) still exits 2, anything else 1.
"""

import sys


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception through Ray's wrappers (the lowest rank's, where several workers failed)."""
    if "ray" not in sys.modules:  # nothing of Ray ran: nothing is wrapped
        return exc
    from ray.exceptions import RayTaskError
    from ray.train import ControllerError, WorkerGroupError

    for _ in range(16):  # wrappers nest a few levels; a cycle must not hang the error path
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
            exc = exc.cause
        elif isinstance(exc, WorkerGroupError) and exc.worker_failures:
            exc = exc.worker_failures[min(exc.worker_failures)]
        elif isinstance(exc, ControllerError):
            exc = exc.controller_failure
        else:
            break
    return exc


def one_line(exc: BaseException) -> str:
    """The exception's type and the first lines of its message, without a traceback."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = " ".join(lines[:3])
    return f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__
