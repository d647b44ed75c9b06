"""How a run's steps become its measured step time: the steady state, not the warm-up or the probes."""

import statistics

from osdp_planners.plan import Plan, Strategy, UnitPlan
from osdp_platform.driver.submit import RunSummary
from osdp_platform.runtime.worker import memory_probe_steps

PLAN = Plan(
    planner="ddp",
    model="test",
    structure_hash="0" * 16,
    world_size=2,
    nodes=1,
    workers_per_node=2,
    micro_batch_size=4,
    seq_len=8,
    units=[UnitPlan(name="root", modules=[""], strategy=Strategy.DDP, shard_group_size=1, param_count=10)],
)


def summary(times: list[float]) -> RunSummary:
    """Steps as the worker logs them on CPU: the probed steps carry a peak (and are slow)."""
    probes = memory_probe_steps(len(times), "cpu")
    steps = [
        {"step_time_s": t, "loss": 1.0} | ({"peak_memory_bytes": 1e6} if i in probes else {})
        for i, t in enumerate(times)
    ]
    return RunSummary("run", PLAN, steps)


def test_warm_up_and_probes_are_not_timed() -> None:
    # 20 steps: a slow first half (start-up contention), probes at steps 1 and 19 made slower still
    times = [1.0, 5.0, *[0.2] * 8, *[0.05 + 0.001 * i for i in range(9)], 5.0]
    run = summary(times)
    steady = [s["step_time_s"] for s in run.steady_steps()]
    assert steady == times[10:19]
    measured = run.measured()
    assert measured["measured_step_time_s"] == statistics.median(times[10:19])
    assert measured["measured_throughput_samples_per_s"] == PLAN.global_batch_size / statistics.median(times[10:19])


def test_short_runs_still_have_a_step_time() -> None:
    # 3 steps: the second half holds only the last (probed) step, and the first is the only unprobed one
    assert [s["step_time_s"] for s in summary([1.0, 0.5, 0.3]).steady_steps()] == [1.0]
    assert [s["step_time_s"] for s in summary([1.0, 0.2, 0.3, 0.25, 0.4]).steady_steps()] == [0.3, 0.25]
    assert summary([0.7]).measured()["measured_step_time_s"] == 0.7
