"""A plan at a micro batch far beyond the batches its model was timed at is timed again at its own batch
and searched again: on a CPU pool's ranks, and in this process as on a GPU, where a probe that runs out
of memory there leaves the first plan, which says that its times are extrapolated."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import ZooModel, plan_zoo, zoo_request
from osdp_planners import make_plan, model_probe
from osdp_planners.compute_probe import TIMING_BATCHES, MeasuredTimes
from osdp_planners.plan import EXTRAPOLATED

# names a device as "cuda" does: the model is timed in this process (a GPU's path), not on a CPU pool's ranks
THIS_PROCESS = "cpu:0"


def test_a_cpu_plan_far_beyond_the_timed_batches_is_timed_again_at_its_own_micro_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe times micro batches 1 and 4; a plan at 32 is searched again on lines through 4 and a
    measurement at 32, so it is priced from what was timed there, not from a line carried 8x past it.
    A plan at 16 keeps the usual probe (its cached measurement: nothing is timed again)."""
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_probe, "quiet", lambda _result: True)
    build = ZooModel("llama", 2)
    far = plan_zoo(build, zoo_request("llama", 1, micro_batch=32), "cpu")
    measured = far.context.measured
    assert measured is not None and measured.batches == (TIMING_BATCHES[-1], 32)
    said = far.plan.predicted.times_from  # "measured", or on a loaded host "measured on a busy host: ..."
    assert said.startswith("measured") and EXTRAPOLATED not in said and far.plan.micro_batch_size == 32, said
    probes = [json.loads(f.read_text()) for f in tmp_path.glob("model-*-r1.json")]
    timed = {tuple(sorted(int(b) for b in p["totals"]["forward"])): p["totals"] for p in probes}
    assert set(timed) == {TIMING_BATCHES, (4, 32)}
    at_32 = timed[(4, 32)]
    for kind, lines in (("forward", measured.forward), ("backward", measured.backward)):
        assert sum(line.at(32) for line in lines.values()) == pytest.approx(at_32[kind]["32"], rel=1e-6), kind

    near = plan_zoo(build, zoo_request("llama", 1, micro_batch=16), "cpu")
    assert near.context.measured is not None and near.context.measured.batches == TIMING_BATCHES
    assert len(list(tmp_path.glob("model-*-r1.json"))) == 2


def test_a_device_plan_far_beyond_the_timed_batches_is_timed_again_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's path: the first plan at 32 was priced on lines through 1 and 4 (its measurement cached
    under those batches); the second timing is cached under (4, 32), not read back from the first."""
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(make_plan, "quiet", lambda _result: True)
    far = plan_zoo(ZooModel("llama", 2), zoo_request("llama", 1, micro_batch=32), THIS_PROCESS)
    measured = far.context.measured
    assert measured is not None and measured.batches == (TIMING_BATCHES[-1], 32)
    assert EXTRAPOLATED not in far.plan.predicted.times_from and far.plan.micro_batch_size == 32
    cached = [MeasuredTimes.from_dict(json.loads(f.read_text())) for f in tmp_path.glob("device-v*.json")]
    assert sorted(t.batches for t in cached) == [TIMING_BATCHES, (4, 32)]


def _out_of_memory_past(largest: int, probe: Callable[..., MeasuredTimes]) -> Callable[..., MeasuredTimes]:
    """`probe` (its last argument: the batches) as a device too small for a micro batch past `largest` runs it."""

    def run(*args: object) -> MeasuredTimes:
        batches = args[-1]
        assert isinstance(batches, tuple)
        if max(batches) > largest:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at micro batch {max(batches)}")
        return probe(*args)

    return run


def test_a_device_plan_whose_batch_runs_the_whole_model_out_of_memory_is_timed_again_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose states fit the probe but whose activations at 32 do not: the whole model's probe runs
    out of memory there, so it is timed block by block at 4 and 32 (one block's activations at a time)."""
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(make_plan, "quiet", lambda _result: True)
    monkeypatch.setattr(make_plan, "measure_times", _out_of_memory_past(TIMING_BATCHES[-1], make_plan.measure_times))
    by_blocks: list[object] = []
    blocks = make_plan.measure_blocks

    def measure_blocks(*args: object) -> MeasuredTimes:
        by_blocks.append(args[-1])
        return blocks(*args)

    monkeypatch.setattr(make_plan, "measure_blocks", measure_blocks)
    far = plan_zoo(ZooModel("llama", 2), zoo_request("llama", 1, micro_batch=32), THIS_PROCESS)
    measured = far.context.measured
    assert by_blocks == [(TIMING_BATCHES[-1], 32)], "the first timing, at 1 and 4, fits whole"
    assert measured is not None and measured.batches == (TIMING_BATCHES[-1], 32)
    assert EXTRAPOLATED not in far.plan.predicted.times_from


def test_a_device_plan_whose_batch_runs_the_probe_out_of_memory_keeps_its_first_times_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model's probe runs out of memory at 32 and so does the block-by-block one it falls back
    to: the plan is the first one, priced on the lines through 1 and 4, and it says so."""
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(make_plan, "quiet", lambda _result: True)
    for name in ("measure_times", "measure_blocks"):
        monkeypatch.setattr(make_plan, name, _out_of_memory_past(TIMING_BATCHES[-1], getattr(make_plan, name)))
    far = plan_zoo(ZooModel("llama", 2), zoo_request("llama", 1, micro_batch=32), THIS_PROCESS)
    assert far.context.measured is not None and far.context.measured.batches == TIMING_BATCHES
    assert far.plan.micro_batch_size == 32 and EXTRAPOLATED in far.plan.predicted.times_from
