"""An elastic run on a cluster of Ray's fake multi-node provider: nodes go and come, the run re-plans and goes on.

The head (no CPUs) has one node type, one worker each, advertising the pool `ELASTIC`; the test asks
the autoscaler for nodes (request_resources, from a subprocess: this process keeps away from the head)
and takes one away by killing its raylet, as a pre-empted spot node goes, with the fake cloud out of
capacity until the test makes room again. On a pool with `hardware.autoscaling` the driver asks for
max_nodes itself, so a node taken away comes back for its request alone. The driver is the
`osdp-platform` CLI in a subprocess, joined to the head's GCS as a user's driver on the cluster would be.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from ray.util.state import list_actors

from helpers import CLI, RECIPES
from osdp_planners.plan import Plan
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.checkpoint import load_state
from osdp_platform.runtime.data import BatchSampler, load_tokens
from osdp_platform.runtime.models import build_sharded
from osdp_platform.runtime.step import build_optimizer, train_step
from ray_head import RayHead, client_env, start_head

pytestmark = pytest.mark.heavy

NODE = {"CPU": 1, "ELASTIC": 1}
NODE_TYPES = {"elastic": {**NODE, "object_store_memory": 100_000_000}}
STEPS = 24
ELASTIC = [
    "hardware.workers_per_node=1",
    "hardware.min_nodes=1",
    "hardware.max_nodes=2",
    "hardware.pool=ELASTIC",
    "hardware.wait_for_nodes_s=120",
    "train.global_batch_size=16",
    "train.checkpoint_every=2",
    f"train.steps={STEPS}",
]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    head = start_head(tmp_path_factory.mktemp("head"), num_cpus=0, node_types=NODE_TYPES, idle_timeout_s=600)
    try:
        yield head
    finally:  # the autoscaler's logs outlive the head, with pytest's temp folders, for a failure to be read
        logs = head.temp_dir / "session_latest" / "logs"
        shutil.copytree(logs, tmp_path_factory.mktemp("head-logs"), dirs_exist_ok=True)
        head.stop()
    assert not head.processes(), "processes of the test cluster outlived it"


def _ask_for_nodes(head: RayHead, count: int) -> None:
    """What an autoscaler is asked to keep up (a fresh request replaces the last; 0: nothing)."""
    code = (
        "import ray, sys\n"
        "from ray.autoscaler.sdk import request_resources\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        f"request_resources(bundles=[{NODE!r}] * {count})\n"
    )
    subprocess.run([sys.executable, "-c", code, head.gcs_address], env=client_env(), check=True, timeout=120)


def _wait(what: str, done: "callable[[], bool]", timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(1)


def _nodes(head: RayHead, count: int, timeout_s: float = 180) -> None:
    assert head.no_capacity is not None
    head.no_capacity.unlink(missing_ok=True)
    _ask_for_nodes(head, count)
    _wait(f"{count} worker node(s) up", lambda: len(head.worker_nodes()) == count, timeout_s)
    _ask_for_nodes(head, 0)  # keep what is there, but replace nothing the test takes away


def _take_node(head: RayHead) -> None:
    """Stop a worker node's raylet, as a pre-empted spot node goes (SIGTERM: the notice it gets), with its
    workers; the fake cloud has no capacity until the test says so, so no node replaces it meanwhile."""
    assert head.no_capacity is not None
    head.no_capacity.touch()
    node = head.worker_nodes()[0]["id"]
    raylets = [p for p in head.processes() if p.name() == "raylet" and f"--node_id={node}" in " ".join(p.cmdline())]
    assert len(raylets) == 1, raylets
    os.kill(raylets[0].pid, signal.SIGTERM)


def _submit(head: RayHead, tmp: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CLI, "submit", str(RECIPES / "tiny.yaml"), *ELASTIC, *overrides, "--address", head.gcs_address],
        cwd=tmp,
        env=client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _tags(db: Path) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{db}")
    found = client.get_experiment_by_name("osdp-tiny")
    runs = client.search_runs([found.experiment_id]) if found else []
    return dict(runs[0].data.tags) if runs else {}


def _tag_at_least(db: Path, tag: str, value: int) -> bool:
    try:
        return int(_tags(db).get(tag, -1)) >= value
    except Exception:  # the driver may hold the sqlite file a moment
        return False


def _reference(recipe_args: list[str], plan: Plan, checkpoint: str, steps: range) -> list[float]:
    """A world of one trained from `checkpoint` under `plan` for `steps` (the shipped step and loader)."""
    recipe = load_recipe(RECIPES / "tiny.yaml", recipe_args)
    torch.manual_seed(recipe.train.seed)
    model = build_sharded(recipe.model, plan, torch.device("cpu"))
    optimizer = build_optimizer(model, recipe.train)
    assert load_state(model, optimizer, checkpoint) == steps.start
    sampler = BatchSampler(load_tokens(recipe.data, recipe.train.seed), plan.seq_len, recipe.train.seed)
    accum, micro = plan.grad_accum_steps, plan.micro_batch_size
    return [float(train_step(model, optimizer, sampler.micro_batches(s, accum, micro, 0, 1), accum)) for s in steps]


def test_a_run_shrinks_when_a_node_goes_and_grows_when_its_driver_has_it_replaced(
    head: RayHead, tmp_path: Path
) -> None:
    """On a pool with hardware.autoscaling the driver keeps the autoscaler asked for max_nodes while it runs.
    The test withdraws its own request once its nodes are up, so the node that replaces the one it takes
    away is launched for the driver's request alone, re-sent while the run goes on."""
    _nodes(head, 2)
    db = tmp_path / "mlflow.db"
    args = [f"tracking.uri=sqlite:///{db}", f"train.checkpoint_dir={tmp_path / 'ckpt'}", "hardware.autoscaling=true"]
    proc = _submit(head, tmp_path, *args)
    try:
        _wait("the first checkpoints", lambda: _tag_at_least(db, "checkpoint_step", 4), 300, proc)
        _take_node(head)
        _wait("a plan for the smaller world", lambda: _tag_at_least(db, "plan_versions", 2), 180, proc)
        # Room in the cloud again: the node launched while the smaller group starts makes it grow at its
        # first checkpoint or later.
        assert head.no_capacity is not None
        head.no_capacity.unlink()
        out, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("osdp-tiny").experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    worlds = client.get_metric_history(run_id, "world_size")
    versions = sorted((m.value, m.step) for m in client.get_metric_history(run_id, "plan_version"))
    assert [int(v) for v, _ in versions] == [1, 2, 3], versions
    by_version = {int(v): s for v, s in versions}
    assert [int(m.value) for m in sorted(worlds, key=lambda m: m.step)] == [2, 1, 2]
    shrunk_at, grown_at = by_version[2], by_version[3]
    assert 0 < shrunk_at < grown_at < STEPS
    predicted = {m.step for m in client.get_metric_history(run_id, "predicted_peak_memory_bytes")}
    assert {0, shrunk_at, grown_at} <= predicted, predicted
    plans = {p.path: p for p in client.list_artifacts(run_id, "plans")}
    assert set(plans) == {"plans/v1-world2.json", "plans/v2-world1.json", "plans/v3-world2.json"}
    small = Plan.from_file(client.download_artifacts(run_id, "plans/v2-world1.json", str(tmp_path)))
    assert small.world_size == 1 and small.global_batch_size == 16 and small.grad_accum_steps == 2
    assert "world size 2 -> 1 at step" in out and "world size 1 -> 2 at step" in out, out[-5000:]

    # Each resize continues the loss curve: the steps after it equal a world of one trained from the checkpoint
    # the resized group loaded (same global batch, same samples per step). A world of one accumulates what two
    # workers all-reduce, so the curves agree to fp32 rounding, compounded over the steps.
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sorted(losses) == list(range(STEPS))
    for start, end, world in ((shrunk_at, grown_at, 2), (grown_at, STEPS, 1)):
        checkpoint = _checkpoint_of(tmp_path / "ckpt", run_id, start, world)
        expected = _reference([*ELASTIC, *args], small, str(checkpoint), range(start, end))
        got = [losses[s] for s in range(start, end)]
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6), (start, got, expected)


def _checkpoint_of(root: Path, run_id: str, step: int, world: int) -> Path:
    """The checkpoint at `step` written by the run's group of `world` workers (one DCP file per rank). A group
    that lost a node may leave a complete checkpoint it never reported; the next group does not load it."""
    found = [
        c
        for c in root.glob(f"tiny-{run_id[:8]}*/checkpoint_{step:06d}")
        if len(list(c.glob("*.distcp"))) == world and (c / ".metadata").is_file()
    ]
    assert len(found) == 1, (step, world, sorted(root.rglob("checkpoint_*")))
    return found[0]


def test_a_shrink_below_every_plan_stops_with_the_planners_message(head: RayHead, tmp_path: Path) -> None:
    _nodes(head, 2)
    db = tmp_path / "mlflow.db"
    # 4 MiB per device: sharded over 2 workers the model fits, on 1 nothing does
    args = [f"tracking.uri=sqlite:///{db}", "hardware.memory_per_device_gb=0.004", "train.steps=400"]
    proc = _submit(head, tmp_path, *args, f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    try:
        _wait("the first checkpoints", lambda: _tag_at_least(db, "checkpoint_step", 2), 300, proc)
        _take_node(head)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out[-5000:]
    assert "hardware.memory_per_device_gb = 0.004: no plan fits" in out and "at least" in out, out[-5000:]
    assert "Traceback" not in out
    found = list_actors(address=head.dashboard_url, filters=[("class_name", "=", "RayTrainWorker")], detail=True)
    pids = {a.pid for a in found}
    assert pids, "no training worker ever ran"
    _wait("every training worker's process gone", lambda: not [p for p in pids if _running(p)], 60)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
