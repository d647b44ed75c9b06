"""Real Ray Train runs on 2 gloo CPU workers: every uniform planner, and `submit` end to end in MLflow."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue

from helpers import RECIPES
from osdp_planners.cpu_wait import SCHEDSTAT
from osdp_planners.plan import Plan
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.driver.submit import submit
from osdp_platform.planning.local import plan_recipe
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.data import BatchSampler, load_tokens
from osdp_platform.runtime.models import build_model
from osdp_platform.runtime.state import WorkerState, build_worker_state
from osdp_platform.runtime.step import build_optimizer, train_step
from osdp_platform.runtime.worker import timed_step, train_loop
from osdp_platform.runtime.worker_env import WORKER_ENV_DEFAULTS

pytestmark = pytest.mark.heavy

PLANNERS = ("ddp", "zero2", "zero3", "hsdp", "osdp")
STEPS = 2
ACCUM = 2  # two micro batches per step: the memory probe must follow the root module's forward twice


def _losses_per_planner(config: dict[str, Any]) -> None:
    import ray.train

    recipe = Recipe.model_validate(config["recipe"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    tokens = load_tokens(recipe.data, recipe.train.seed)
    out: dict[str, tuple[list[float], list[int]]] = {}
    for name, plan_json in config["plans"].items():
        state = build_worker_state(recipe, Plan.model_validate(plan_json), torch.device("cpu"), tokens=tokens)
        losses, peaks = [], []
        for step in range(STEPS):
            mean = torch.zeros(())

            def one_step(state: WorkerState = state, step: int = step, mean: torch.Tensor = mean) -> None:
                mean.copy_(state.step(step, rank, world))

            timing = timed_step(state.model, state.optimizer, one_step, torch.device("cpu"), world, probe=True)
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
            peaks.append(int(max(timing.peaks)))
        out[name] = (losses, peaks)
    if rank == 0:
        config["results"].put(out)


def _reference_losses(recipe: Recipe, micro_batch: int, world: int, accum: int) -> list[float]:
    """One process fed the whole global batch: what every sharded run must reproduce."""
    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe.model)
    opt = build_optimizer(model, recipe.train)
    sampler = BatchSampler(load_tokens(recipe.data, 0), recipe.data.seq_len, 0)
    losses = []
    for step in range(STEPS):
        x, y = sampler.global_batch(step, micro_batch * world * accum)
        batches = list(zip(x.split(micro_batch * world), y.split(micro_batch * world), strict=True))
        losses.append(float(train_step(model, opt, batches, accum)))
    return losses


def test_every_planner_trains_with_gradient_accumulation_on_two_gloo_workers(ray_cluster: None) -> None:
    """The shipped step and memory probe (worker.timed_step) with 2 micro batches per step, every planner:
    losses equal one process fed the whole global batch, and the measured peak is the predicted one."""
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        ["train.micro_batch_size=2", f"train.global_batch_size={2 * 2 * ACCUM}", "data.seq_len=32"],
    )
    plans = {}
    for name in PLANNERS:
        plans[name] = plan_recipe(
            recipe.model_copy(update={"planner": recipe.planner.model_copy(update={"name": name})})
        ).plan
        assert plans[name].grad_accum_steps == ACCUM, name
    results = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        _losses_per_planner,
        train_loop_config={
            "recipe": recipe.model_dump(mode="json"),
            "plans": {n: p.model_dump(mode="json") for n, p in plans.items()},
            "results": results,
        },
        scaling_config=ScalingConfig(num_workers=2),
    )
    trainer.fit()
    measured = results.get(timeout=10)
    reference = _reference_losses(recipe, 2, 2, ACCUM)
    for name in PLANNERS:
        losses, peaks = measured[name]
        assert losses == pytest.approx(reference, rel=1e-5), name
        predicted = plans[name].predicted.peak_memory_bytes
        assert predicted * 0.98 <= peaks[-1] <= predicted * 1.02, (name, peaks, predicted)
    assert reference[1] < reference[0]


@dataclass(frozen=True)
class RecordWorkerEnv:
    """The worker loop, after writing what each worker's environment holds of the runtime's variables."""

    folder: str

    def __call__(self, config: dict[str, Any]) -> None:
        import ray.train

        seen = {name: os.environ.get(name) for name in WORKER_ENV_DEFAULTS}
        (Path(self.folder) / f"env{ray.train.get_context().get_world_rank()}.json").write_text(json.dumps(seen))
        train_loop(config)


def test_submit_tracks_run_in_mlflow(ray_cluster: None, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = 4
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        [f"train.steps={steps}", "data.seq_len=32", f"tracking.uri=sqlite:///{workdir}/mlflow.db"],
    )
    monkeypatch.setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", "0")  # the user's own setting wins over the default
    summary = submit(recipe, train_fn=RecordWorkerEnv(str(workdir)))
    for rank in range(2):
        seen = json.loads((workdir / f"env{rank}.json").read_text())
        assert seen == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == str(steps)
    assert run.data.params["model.family"] == "llama"
    artifacts = {a.path for a in client.list_artifacts(summary.run_id)}
    assert {"plan.json", "recipe.yaml", "profile.json"} <= artifacts
    plan_path = mlflow.artifacts.download_artifacts(
        run_id=summary.run_id, artifact_path="plan.json", dst_path=str(workdir), tracking_uri=client.tracking_uri
    )
    plan = Plan.from_file(plan_path)
    assert plan.planner == "osdp" and plan.world_size == 2
    logged = run.data.metrics
    for key in (
        "predicted_peak_memory_bytes",
        "predicted_step_time_s",
        "predicted_throughput_samples_per_s",
        "measured_peak_memory_bytes",
        "measured_step_time_s",
        "peak_memory_ratio",
        "step_time_ratio",
    ):
        assert key in logged, key
    assert logged["predicted_peak_memory_bytes"] == plan.predicted.peak_memory_bytes
    assert logged["peak_memory_ratio"] == pytest.approx(
        logged["measured_peak_memory_bytes"] / logged["predicted_peak_memory_bytes"]
    )
    for key in ("loss", "step_time_s", "tokens_per_s"):
        history = client.get_metric_history(summary.run_id, key)
        assert [m.step for m in history] == list(range(steps)), key
    assert client.get_metric_history(summary.run_id, "peak_memory_bytes")
    per_rank = [client.get_metric_history(summary.run_id, f"step_time_s/rank{r}") for r in range(2)]
    assert all(len(h) == steps for h in per_rank)
    for step_max, r0, r1 in zip(client.get_metric_history(summary.run_id, "step_time_s"), *per_rank, strict=True):
        assert step_max.value == max(r0.value, r1.value)
    loss = [m.value for m in client.get_metric_history(summary.run_id, "loss")]
    assert loss[-1] < loss[0]
    if SCHEDSTAT.exists():  # Linux says how long each rank's step waited for a CPU
        waits = client.get_metric_history(summary.run_id, "cpu_wait_share")
        assert [m.step for m in waits] == list(range(steps)) and all(0.0 <= m.value <= 1.0 for m in waits)
        assert 0.0 <= logged["measured_cpu_wait_share"] <= 1.0


def test_a_plan_that_does_not_fit_reaches_the_user_from_the_planner_actor(
    ray_cluster: None, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DDP does not fit the default recipe's budget: the actor's error arrives whole, exit code 2, no run."""
    code = main(["submit", str(RECIPES / "tiny.yaml"), "planner.name=ddp", f"tracking.uri=sqlite:///{workdir}/m.db"])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR, err
    assert "hardware.memory_per_device_gb" in err and "no ddp plan fits" in err and "fix:" in err
    assert "Traceback" not in err and "UnserializableException" not in err
    assert not (workdir / "m.db").exists()
