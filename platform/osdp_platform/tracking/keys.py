"""What the platform writes to MLflow, by name: run tags, run kinds, metrics, and a plan's params and metrics.

The writer (runs.py) and the readers (records.py, compare.py) share these names, so a run written
by one version is read by the same keys.
"""

import hashlib
import json
from enum import StrEnum

from osdp_planners.plan import Plan, Strategy
from osdp_platform.recipe.schema import Recipe

MAX_LIST_PARAM_CHARS = 1000  # unit lists in params are cut here; the plan table artifact has them all


class Tag(StrEnum):
    KIND = "run_kind"  # RunKind
    PLANNER = "planner"
    MODEL = "model"
    WORLD_SIZE = "world_size"
    HARDWARE = "hardware"  # the pool: nodes x workers per node, preset
    STRUCTURE_HASH = "structure_hash"
    RECIPE_HASH = "recipe_hash"
    PLAN_HASH = "plan_hash"  # the plan's decisions, not its predictions
    PLAN_STATUS = "plan_status"  # plan runs: PLANNED or DOES_NOT_FIT
    CHECKPOINT_PATH = "checkpoint_path"
    CHECKPOINT_STEP = "checkpoint_step"  # the step a resume continues at
    RESUMED_FROM_RUN = "resumed_from_run"
    RESUMED_FROM_CHECKPOINT = "resumed_from_checkpoint"
    RESUMED_AT_STEP = "resumed_at_step"
    COMPARED_RUNS = "compared_runs"
    SWEEP = "sweep"  # the sweep a run belongs to
    RESTARTS = "restarts"  # how often Ray Train restarted the workers after a failure
    SPLIT_PLAN_NODES = "split_plan_nodes"  # plan nodes whose workers landed on more than one machine


class RunKind(StrEnum):
    TRAIN = "train"
    PLAN = "plan"
    COMPARISON = "comparison"


STRATEGIES = [s.value for s in Strategy]
PLANNED = "planned"
DOES_NOT_FIT = "does not fit"


class Metric(StrEnum):
    """Run-level metrics; the per-step ones are the worker's (loss, step_time_s, tokens_per_s, ...)."""

    PREDICTED_PEAK_MEMORY = "predicted_peak_memory_bytes"  # allocated
    PREDICTED_RESERVED_MEMORY = "predicted_reserved_memory_bytes"  # the allocator's reserve (GPU)
    PREDICTED_STEP_TIME = "predicted_step_time_s"
    PREDICTED_THROUGHPUT = "predicted_throughput_samples_per_s"
    MEASURED_PEAK_MEMORY = "measured_peak_memory_bytes"
    MEASURED_RESERVED_MEMORY = "measured_reserved_memory_bytes"
    MEASURED_STEP_TIME = "measured_step_time_s"
    MEASURED_THROUGHPUT = "measured_throughput_samples_per_s"
    MEASURED_CPU_WAIT = "measured_cpu_wait_share"  # of a steady step, the most a rank waited for a CPU
    PEAK_MEMORY_RATIO = "peak_memory_ratio"  # measured / predicted
    RESERVED_MEMORY_RATIO = "reserved_memory_ratio"
    STEP_TIME_RATIO = "step_time_ratio"
    FIRST_LOSS = "first_loss"
    FINAL_LOSS = "final_loss"
    RESTARTS = "restarts"  # one point per restart of the workers, at the step they resumed from


def baseline_metric(strategy: str, quantity: str) -> str:
    """A uniform plan's prediction, e.g. baseline_zero3_throughput_samples_per_s (plan.baselines)."""
    return f"baseline_{strategy}_{quantity}"


def system_metric(node: str, name: str) -> str:
    """MLflow's naming for a node's system metrics, so its UI shows them as system metrics."""
    return f"system/{node}/{name}"


def _digest(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def recipe_hash(recipe: Recipe) -> str:
    """What was asked for: the recipe without its run name and tracking section."""
    return _digest(recipe.model_dump(mode="json", exclude={"name", "tracking"}))


def plan_hash(plan: Plan) -> str:
    """What was decided: two plans with equal hashes train alike, whatever their predictions."""
    decided = plan.model_dump(mode="json", exclude={"predicted", "baselines"})
    for unit in decided["units"]:
        unit.pop("predicted_memory_bytes")
        unit.pop("predicted_time_s")
    return _digest(decided)


def hardware_label(recipe: Recipe) -> str:
    hw = recipe.hardware
    nodes = f"{hw.min_nodes}-{hw.max_nodes}" if hw.elastic else str(hw.nodes)
    return f"{nodes}x{hw.workers_per_node} {hw.preset}"


def _names(items: list[str]) -> str:
    text = " ".join(items)
    return text if len(text) <= MAX_LIST_PARAM_CHARS else text[:MAX_LIST_PARAM_CHARS] + " ..."


def plan_params(plan: Plan) -> dict[str, str]:
    """The plan's shape in a few params: batch, units per strategy, split factors, checkpointed units."""
    out: dict[str, int | str] = {
        "plan.micro_batch_size": plan.micro_batch_size,
        "plan.grad_accum_steps": plan.grad_accum_steps,
        "plan.global_batch_size": plan.global_batch_size,
        "plan.world_size": plan.world_size,
        "plan.units": len(plan.units),
    }
    for u in plan.units:
        kind = f"hsdp_g{u.shard_group_size}" if u.strategy.value == "hsdp" else u.strategy.value
        out[f"plan.units.{kind}"] = int(out.get(f"plan.units.{kind}", 0)) + 1
        if u.split > 1:
            out[f"plan.units.split_{u.split}"] = int(out.get(f"plan.units.split_{u.split}", 0)) + 1
    out["plan.units.checkpointed"] = sum(u.checkpoint for u in plan.units)
    out["plan.split_units"] = _names([f"{u.name}={u.split}" for u in plan.units if u.split > 1]) or "-"
    out["plan.checkpointed_units"] = _names([u.name for u in plan.units if u.checkpoint]) or "-"
    return {k: str(v) for k, v in out.items()}


def plan_metrics(plan: Plan) -> dict[str, float]:
    """The planner's predictions for this plan and for every uniform plan, at one step so they chart together."""
    p = plan.predicted
    values: dict[str, float | None] = {
        Metric.PREDICTED_PEAK_MEMORY: p.peak_memory_bytes,
        Metric.PREDICTED_RESERVED_MEMORY: p.reserved_memory_bytes,
        Metric.PREDICTED_STEP_TIME: p.step_time_s,
        Metric.PREDICTED_THROUGHPUT: p.throughput_samples_per_s,
    }
    for name, b in plan.baselines.items():
        values[baseline_metric(name, "fits")] = float(b.fits)
        values[baseline_metric(name, "micro_batch_size")] = b.micro_batch_size
        values[baseline_metric(name, "peak_memory_bytes")] = b.peak_memory_bytes
        values[baseline_metric(name, "step_time_s")] = b.step_time_s
        values[baseline_metric(name, "throughput_samples_per_s")] = b.throughput_samples_per_s
    return {k: float(v) for k, v in values.items() if v is not None}
