"""MLflow: one run per submit with the recipe, the plan, predictions and the measured per-step metrics."""

from dataclasses import dataclass

import mlflow
from mlflow.tracking import MlflowClient

from osdp_planners.plan import Plan
from osdp_platform.recipe import Recipe
from osdp_platform.recipe_loader import flatten, recipe_to_yaml

MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch


def predicted_metrics(plan: Plan) -> dict[str, float]:
    """The planner's predictions under the names they are compared with (predicted_* next to measured)."""
    p = plan.predicted
    values = {
        "predicted_peak_memory_bytes": p.peak_memory_bytes,
        "predicted_step_time_s": p.step_time_s,
        "predicted_throughput_samples_per_s": p.throughput_samples_per_s,
    }
    return {k: float(v) for k, v in values.items() if v is not None}


@dataclass
class RunTracker:
    """Owns one MLflow run; only the driver writes to it, so any tracking store works."""

    uri: str
    run_id: str

    @classmethod
    def start(cls, recipe: Recipe, plan: Plan) -> "RunTracker":
        uri = recipe.tracking.resolved_uri
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.set_experiment(recipe.tracking.experiment)
        client = MlflowClient(uri)
        run = client.create_run(
            experiment.experiment_id,
            run_name=recipe.name,
            tags={"planner": plan.planner, "model": plan.model, "world_size": str(plan.world_size),
                  "structure_hash": plan.structure_hash},
        )
        tracker = cls(uri, run.info.run_id)
        params = flatten(recipe)
        params |= {"plan.micro_batch_size": str(plan.micro_batch_size),
                   "plan.grad_accum_steps": str(plan.grad_accum_steps),
                   "plan.global_batch_size": str(plan.global_batch_size)}
        items = sorted(params.items())
        for i in range(0, len(items), 100):
            client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, v) for k, v in items[i:i + 100]])
        client.log_text(run.info.run_id, recipe_to_yaml(recipe), "recipe.yaml")
        client.log_text(run.info.run_id, plan.to_json(), "plan.json")
        tracker.log_metrics(predicted_metrics(plan), step=0)
        return tracker

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.uri)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.log_steps([(step, metrics)])

    def log_steps(self, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Several steps' metrics in as few requests as MLflow allows (one request costs more than its rows)."""
        now = mlflow.utils.time.get_current_time_millis()
        rows = [mlflow.entities.Metric(k, float(v), now, step) for step, metrics in steps for k, v in metrics.items()]
        client = self.client
        for i in range(0, len(rows), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=rows[i:i + MAX_METRICS_PER_BATCH])

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
