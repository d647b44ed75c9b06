"""What crosses from the planner to the platform: the plan, and why its numbers are what they are.

The explanation is plain data (numbers, names, JSON text), so the platform's reports draw it as it is
and never call the cost model; a change to the cost model changes the charts with no change there.
The uniform baselines and the search's proof travel in the plan itself (`Plan.baselines`, `Plan.search`),
since a plan file is read without its explanation.
"""

from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from osdp_planners.plan import Plan

if TYPE_CHECKING:
    from osdp_planners.evaluate import Context


@dataclass(frozen=True)
class UnitSeconds:
    """One unit's share of a predicted step, over all its micro batches."""

    compute_s: float  # forward, backward and any recomputation, with FSDP2's copies where measured
    communication_s: float  # what compute does not hide (all of it on CPU, where gloo blocks)
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.optimizer_s


@dataclass(frozen=True)
class Explanation:
    """The cost model's account of one plan, as the planner computed it."""

    timeline: list[tuple[str, float]]  # (event, bytes one rank holds then) over one steady-state step
    units: dict[str, UnitSeconds]
    fixed_s: float  # what FSDP2 costs per step whatever the plan (once per micro batch)
    computed_from: str  # JSON: the profile, measured compute and collectives, the device preset

    @property
    def step_time_s(self) -> float:
        return sum(u.total_s for u in self.units.values()) + self.fixed_s

    @property
    def peak_bytes(self) -> float:
        return max(v for _, v in self.timeline)


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer. `context` is the planner's own working state (profile, measured times,
    topology), kept for the planner's follow-ups (a re-plan at another world size, a what-if
    evaluation in the benchmarks): the platform hands it back to the planner and never reads it."""

    plan: Plan
    explanation: Explanation
    context: "Context" = field(repr=False, compare=False)


def jsonable(obj: Any) -> Any:
    """Dataclasses as dicts, like dataclasses.asdict, but a key that is not a string (a profile's
    Variant) is written as its repr, since JSON keys are strings."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else repr(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj
