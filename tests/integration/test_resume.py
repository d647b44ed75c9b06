"""Checkpoint and resume on real Ray Train workers: DCP files, a killed worker, `--resume` under a new plan.

Two trainings share one MLflow store: a run on 2 workers whose worker 1 exits hard before step 3 on its
first attempt (checkpoints every 2 steps, stored under a `file://` URI as train.checkpoint_dir, only the
newest kept), and a `--resume` of that run on 4 workers under DDP with other split factors. Both must
reproduce the per-step losses of one process trained on the same global batches (the reference).
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from helpers import RECIPES
from osdp_planners.plan import Strategy
from osdp_planners.uniform import uniform_plan
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.driver.submit import RunSummary, submit
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.models import build_model
from osdp_platform.runtime.worker import train_loop
from reference import reference_run

pytestmark = pytest.mark.heavy

REFERENCE_STEPS = 8
FAULT_STEPS = 6
FAULT_AT = 3
BASE = ["data.seq_len=32", "train.micro_batch_size=4"]  # global batch 8 on 2 workers
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class KillOnce:
    """Train loop wrapper: worker rank 1 exits hard before step `at` the first time (the marker remembers)."""

    marker: str
    at: int

    def __call__(self, config: dict[str, Any]) -> None:
        train_loop(config, before_step=self._maybe_die)

    def _maybe_die(self, step: int) -> None:
        import ray.train

        if step == self.at and ray.train.get_context().get_world_rank() == 1 and not Path(self.marker).exists():
            Path(self.marker).touch()
            os._exit(1)


@dataclass(frozen=True)
class Store:
    root: Path

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.root}/mlflow.db"

    def overrides(self, *extra: str) -> list[str]:
        return [*BASE, f"tracking.uri={self.uri}", *extra]

    def losses(self, run_id: str) -> list[tuple[int, float]]:
        """(step, loss) in logging order: a re-run step appears once per run of it."""
        history = MlflowClient(self.uri).get_metric_history(run_id, "loss")
        return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


@pytest.fixture(scope="module")
def store(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """One temp folder (runs/, mlflow.db) for the module's runs, which build on one another."""
    root = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("RAY_ADDRESS", raising=False)
        yield Store(root)


@pytest.fixture(scope="module")
def reference(store: Store) -> list[float]:
    recipe = load_recipe(RECIPES / "tiny.yaml", store.overrides(f"train.steps={REFERENCE_STEPS}"))
    losses, _ = reference_run(lambda: build_model(recipe.model), recipe, GLOBAL_BATCH, REFERENCE_STEPS)
    return losses


@pytest.fixture(scope="module")
def faulty(store: Store) -> RunSummary:
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        store.overrides(
            f"train.steps={FAULT_STEPS}",
            "train.checkpoint_every=2",
            f"train.checkpoint_dir=file://{store.root}/ckpts",
            "train.checkpoints_to_keep=1",
        ),
    )
    return submit(recipe, train_fn=KillOnce(str(store.root / "killed"), FAULT_AT))


def test_killed_worker_resumes_from_last_checkpoint(store: Store, reference: list[float], faulty: RunSummary) -> None:
    assert (store.root / "killed").exists(), "the fault never fired"
    logged = store.losses(faulty.run_id)
    # step 2 ran twice: before the kill, and again after the restart from the checkpoint at step 2, which
    # restored the state the first attempt had to the bit
    assert [step for step, _ in logged] == [0, 1, 2, 2, 3, 4, 5]
    assert logged[2] == logged[3], logged
    for step, loss in logged:
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert [s["loss"] for s in faulty.steps] == pytest.approx(reference[:FAULT_STEPS], rel=1e-5)
    client = MlflowClient(store.uri)
    tags = client.get_run(faulty.run_id).data.tags
    assert tags["checkpoint_step"] == str(FAULT_STEPS)
    assert tags["restarts"] == "1"  # the restart is on record: a tag, and an event at the step it resumed from
    restarts = client.get_metric_history(faulty.run_id, "restarts")
    assert [(m.step, m.value) for m in restarts] == [(2, 1.0)]  # resumed from step 2's checkpoint
    uri = tags["checkpoint_path"]
    assert uri.startswith(f"file://{store.root}/ckpts/")
    folder = Path(uri.removeprefix("file://"))
    assert folder.name == f"checkpoint_{FAULT_STEPS:06d}" and folder.parent.parent == store.root / "ckpts"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in folder.iterdir()}
    kept = {p.name for p in folder.parent.iterdir() if p.name.startswith("checkpoint_")}
    # checkpoints_to_keep=1: Ray Train deleted step 4's when step 6's registered (step 2's stays if the kill
    # came before Ray Train registered it: it only knows what it registered)
    assert folder.name in kept and "checkpoint_000004" not in kept


def _split_ddp_plan(store: Store, recipe_overrides: list[str]) -> Path:
    """A 4-worker DDP plan whose first MLP is split in 2 and second attention in 4 (a manual plan file)."""
    recipe = load_recipe(RECIPES / "tiny.yaml", store.overrides(*recipe_overrides))
    base = uniform_plan(build_model(recipe.model, "meta"), plan_request(recipe), Strategy.DDP, 2, 1)
    splits = {"layers.0.mlp": 2, "layers.1.attn": 4}
    plan = base.model_copy(
        update={"units": [u.model_copy(update={"split": splits.get(u.name, 1)}) for u in base.units]}
    )
    path = store.root / "split-ddp-plan.json"
    path.write_text(plan.to_json())
    return path


@pytest.fixture(scope="module")
def resumed(store: Store, faulty: RunSummary) -> RunSummary:
    """The faulty run resumed on 4 workers under a manual DDP plan with other split factors."""
    overrides = [
        f"train.steps={REFERENCE_STEPS}",
        "hardware.workers_per_node=4",
        "train.micro_batch_size=2",
        f"train.global_batch_size={GLOBAL_BATCH}",
    ]
    plan_file = _split_ddp_plan(store, overrides)
    recipe = load_recipe(
        RECIPES / "tiny.yaml", store.overrides(*overrides, "planner.name=manual", f"planner.plan_file={plan_file}")
    )
    return submit(recipe, resume=faulty.run_id)


def test_resume_under_another_plan_worker_count_and_split(
    store: Store, reference: list[float], faulty: RunSummary, resumed: RunSummary
) -> None:
    """Model and optimizer state are saved under unsplit names, so other split factors load them."""
    summary = resumed
    assert summary.plan.world_size == 4 and {u.strategy for u in summary.plan.units} == {Strategy.DDP}
    saved = {u.name: u.split for u in faulty.plan.units}
    assert any(u.split != saved[u.name] for u in summary.plan.units)
    logged = store.losses(summary.run_id)
    assert [step for step, _ in logged] == list(range(FAULT_STEPS, REFERENCE_STEPS))
    for step, loss in logged:
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    tags = MlflowClient(store.uri).get_run(summary.run_id).data.tags
    assert tags["resumed_from_run"] == faulty.run_id
    assert tags["resumed_at_step"] == str(FAULT_STEPS)


def _submit_cli(store: Store, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["submit", str(RECIPES / "tiny.yaml"), *store.overrides(), *args])
    return code, capsys.readouterr().err


def test_resume_refuses_what_it_cannot_continue(
    store: Store, faulty: RunSummary, resumed: RunSummary, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _submit_cli(store, capsys, "--resume", "0123456789abcdef")
    assert code == EXIT_USER_ERROR and "--resume = '0123456789abcdef'" in err and "no MLflow run" in err
    runs = MlflowClient(store.uri).search_runs(
        [MlflowClient(store.uri).get_experiment_by_name("osdp-tiny").experiment_id]
    )
    assert {r.info.run_id for r in runs if "checkpoint_path" not in r.data.tags} == {resumed.run_id}
    code, err = _submit_cli(store, capsys, "--resume", resumed.run_id)  # it checkpointed nothing
    assert code == EXIT_USER_ERROR and "wrote no checkpoint" in err and "train.checkpoint_every" in err
    code, err = _submit_cli(store, capsys, f"train.steps={FAULT_STEPS}", "--resume", faulty.run_id)
    assert code == EXIT_USER_ERROR and f"train.steps = {FAULT_STEPS}" in err and f"above {FAULT_STEPS}" in err


def test_resume_refuses_another_model(store: Store, faulty: RunSummary, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _submit_cli(
        store, capsys, "model.kwargs.n_layers=3", f"train.steps={REFERENCE_STEPS}", "--resume", faulty.run_id
    )
    assert code == EXIT_USER_ERROR and "structure hash" in err and "same model section" in err
