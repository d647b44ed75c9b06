"""How much of a measurement the host kept the measuring thread waiting for a CPU.

A probe's timings stand for a worker with a core of its own only if the probe had its cores. Timed
beside the test suite on a 2-core host, the tiny model's probe came out about 3x slower than on the
quiet host, and, cached, it made every later plan of that model predict steps 2.4x too slow. Linux
counts per thread the time it was runnable but not running (the second field of
/proc/thread-self/schedstat); the probes record that share of their wall time, less what their own
ranks cause (more ranks than cores wait for each other, as the workers will), and the plan says
when the rest was large. On this quiet 2-core host two pinned ranks waited 7% (model probe) and
16% (the collectives' probe: gloo's threads share the rank's core); beside two spinning processes,
37% and 31%.
"""

import os
import time
from pathlib import Path
from typing import Any

SCHEDSTAT = Path("/proc/thread-self/schedstat")
BUSY_SHARE = 0.25  # a probe whose ranks waited longer than this share of its time for a CPU is slow
BUSY_TIMES = "measured on a busy host"  # how a plan's `times_from` begins when its probe was slow so


def run_queue_wait_s() -> float | None:
    """Seconds this thread has spent runnable and waiting for a CPU; None where the kernel does not say."""
    try:
        return int(SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class WaitMeter:
    """The share of the wall time since it was made that this thread spent waiting for a CPU."""

    def __init__(self) -> None:
        self._waited, self._started = run_queue_wait_s(), time.perf_counter()

    def share(self, ranks: int = 1) -> float | None:
        """Of the time since, what this thread waited beyond the 1 - cores/ranks that `ranks` busy
        processes on this host's cores wait for each other (None where the kernel does not say)."""
        now, wall = run_queue_wait_s(), time.perf_counter() - self._started
        if now is None or self._waited is None or wall <= 0:
            return None
        return max((now - self._waited) / wall - max(1 - (os.cpu_count() or 1) / ranks, 0.0), 0.0)


def quiet(measurement: dict[str, Any]) -> bool:
    """Whether a probe's result (its `cpu_wait_share`) was taken with the host's cores to itself: only then
    is it kept for later plans. Cached, one timed beside other work would slow every later plan of the
    model (the tiny Llama's, timed beside a benchmark: 3.4x its step)."""
    return (measurement.get("cpu_wait_share") or 0.0) <= BUSY_SHARE
