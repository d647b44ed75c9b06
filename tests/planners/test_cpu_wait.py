"""A probe knows when the host kept it waiting for a CPU, and the plan says so."""

import dataclasses
import os
import subprocess
import sys

import pytest

from helpers import ZooModel, context, plan_zoo, zoo_request
from osdp_planners.assemble import _times_from
from osdp_planners.compute_probe import EXTRAPOLATION_SAID, TIMING_BATCHES, MeasuredTimes
from osdp_planners.cpu_wait import BUSY_SHARE, SCHEDSTAT
from osdp_planners.plan import EXTRAPOLATED
from osdp_planners.profile import Linear1
from osdp_platform.tracking.report import comparison, slow_times

# Pinned to one core beside a process that spins on the same core, a spinning thread gets about half of it.
CONTENDED = """
import os, subprocess, sys, time
from osdp_planners.cpu_wait import WaitMeter
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
time.sleep(0.3)
meter = WaitMeter()
end = time.perf_counter() + 1.0
while time.perf_counter() < end:
    pass
cores = os.cpu_count()
print(meter.share(), meter.share(cores + 1), cores)
rival.kill()
"""


@pytest.mark.skipif(not SCHEDSTAT.exists() or not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_thread_sharing_its_core_waits_about_half_the_time() -> None:
    out = subprocess.run([sys.executable, "-c", CONTENDED], capture_output=True, text=True, timeout=60, check=True)
    alone, among_ranks, cores = map(float, out.stdout.split())
    assert alone > 0.3, out.stdout
    # one rank more than cores: they wait 1/(cores+1) of the time for each other; only the rest is the host's
    assert among_ranks == pytest.approx(max(alone - 1 / (cores + 1), 0.0), abs=0.02), out.stdout


def test_a_plan_timed_on_a_busy_host_says_its_times_are_slow() -> None:
    """The probe's recorded wait decides what the plan says of its times, and the summary shows it."""
    ctx = context("llama")
    lines = {u.name: Linear1(0.01, 0.0) for u in ctx.profile.units}
    times = MeasuredTimes(lines, lines, 1e-9)
    quiet = dataclasses.replace(ctx, measured=dataclasses.replace(times, cpu_wait_share=BUSY_SHARE / 2))
    assert _times_from(quiet, 4) == "measured"
    busy = dataclasses.replace(ctx, measured=dataclasses.replace(times, cpu_wait_share=0.4))
    said = _times_from(busy, 4)
    assert said.startswith("measured on a busy host") and "40%" in said and "not kept" in said
    result = plan_zoo(ZooModel("llama", 2), zoo_request("llama", 2))
    predicted = result.plan.predicted.model_copy(update={"times_from": said})
    shown = comparison(dataclasses.replace(result, plan=result.plan.model_copy(update={"predicted": predicted})))
    assert f"(times {said})" in shown
    assert slow_times(result.plan) is None
    assert slow_times(result.plan.model_copy(update={"predicted": predicted})) == f"the plan's times were {said}"


def test_a_plan_far_beyond_the_timed_micro_batches_says_its_times_are_extrapolated() -> None:
    """The probe times micro batches 1 and 4; a plan at 4x that is priced as timed, one beyond it says its
    line was carried that far, and a run is warned (on CPU such steps ran up to 2.2x the prediction)."""
    ctx = context("llama")
    lines = {u.name: Linear1(0.01, 0.0) for u in ctx.profile.units}
    quiet = dataclasses.replace(ctx, measured=MeasuredTimes(lines, lines, 1e-9, cpu_wait_share=0.0))
    timed = TIMING_BATCHES[-1]
    assert _times_from(quiet, EXTRAPOLATION_SAID * timed) == "measured"
    far = 32 * timed
    said = _times_from(quiet, far)
    assert said.startswith(f"measured, {EXTRAPOLATED} on a line") and f" to {far}, 32x the largest" in said, said
    busy = dataclasses.replace(quiet, measured=dataclasses.replace(quiet.measured, cpu_wait_share=0.4))
    both = _times_from(busy, far)
    assert both.startswith("measured on a busy host") and EXTRAPOLATED in both, both
    result = plan_zoo(ZooModel("llama", 2), zoo_request("llama", 2))
    predicted = result.plan.predicted.model_copy(update={"times_from": said})
    assert slow_times(result.plan.model_copy(update={"predicted": predicted})) == f"the plan's times were {said}"
