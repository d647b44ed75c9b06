"""OSDP planners: decide per sharding unit how its parameters are held, and the batch size."""

from osdp_planners.make_plan import Builder, PlanResult, build_context, make_plan_for
from osdp_planners.plan import Plan
from osdp_planners.request import PlanRequest

__all__ = ["Builder", "Plan", "PlanRequest", "PlanResult", "build_context", "make_plan_for"]
