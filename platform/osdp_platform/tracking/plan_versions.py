"""An elastic run's plans in MLflow: one version per (re)start of its worker group, on the same run.

Version 1 is the run's plan.json with its predictions at step 0 (runs.RunTracker.start). Each later
version is the plan for the world size the group had when it started again: its JSON as artifact
`plans/v<N>-world<W>.json`, and, at the step it resumed from, points of `plan_version`, `world_size`
and the predicted step time and peak memory, so the run's charts show where and how the plan changed.
"""

from osdp_planners.plan import Plan
from osdp_platform.tracking.keys import Metric, Tag, plan_hash
from osdp_platform.tracking.runs import RunTracker

PLAN_VERSION = "plan_version"
WORLD_SIZE = "world_size"
PLAN_VERSIONS_TAG = "plan_versions"


def plan_artifact(version: int, plan: Plan) -> str:
    return f"plans/v{version}-world{plan.world_size}.json"


def record_plan_version(tracker: RunTracker, version: int, step: int, plan: Plan) -> None:
    """Plan `version` (1 = the first) took over at `step`."""
    tracker.log_text(plan.to_json(), plan_artifact(version, plan))
    points = {PLAN_VERSION: float(version), WORLD_SIZE: float(plan.world_size)}
    if plan.predicted.step_time_s:
        points[Metric.PREDICTED_STEP_TIME] = plan.predicted.step_time_s
    if plan.predicted.peak_memory_bytes:
        points[Metric.PREDICTED_PEAK_MEMORY] = float(plan.predicted.peak_memory_bytes)
    tracker.log_metrics(points, step)
    tracker.set_tags(
        {PLAN_VERSIONS_TAG: str(version), Tag.WORLD_SIZE: str(plan.world_size), Tag.PLAN_HASH: plan_hash(plan)}
    )
