"""OSDP planners: decide per sharding unit how its parameters are held, and the batch size.

The names below load on first use: `osdp_planners.errors` (which every CLI command imports to
report a mistake) must not pull in the profiler, torch's compiler and the solver.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from osdp_planners.explanation import Explanation, PlanResult
    from osdp_planners.make_plan import Builder, build_context, make_plan_for
    from osdp_planners.plan import Plan
    from osdp_planners.request import PlanRequest

_HOME = {
    "Builder": "make_plan",
    "Explanation": "explanation",
    "PlanResult": "explanation",
    "build_context": "make_plan",
    "make_plan_for": "make_plan",
    "Plan": "plan",
    "PlanRequest": "request",
}

__all__ = ["Builder", "Explanation", "Plan", "PlanRequest", "PlanResult", "build_context", "make_plan_for"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'osdp_planners' has no attribute {name!r}")
    return getattr(import_module(f"osdp_planners.{_HOME[name]}"), name)
