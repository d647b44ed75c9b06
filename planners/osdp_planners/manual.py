"""A plan the user wrote (planner.name=manual): read, checked against the model, the pool, the recipe
and the budget, then evaluated like any other, so that a hand edit the runtime cannot run, or one that
overruns the memory budget, is refused with what is wrong before anything trains."""

from pydantic import ValidationError
from torch import nn

from osdp_planners.choice import Choice
from osdp_planners.errors import UserError
from osdp_planners.evaluate import Context, evaluate
from osdp_planners.options import Option
from osdp_planners.plan import Plan
from osdp_planners.request import PlanRequest
from osdp_planners.space import unit_option_lists
from osdp_planners.units import structure_hash


def _why_not_a_plan(exc: Exception) -> str:
    """What is wrong with a plan file, in the file's own terms: each field's path and message, without
    pydantic's error codes and links."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
    return f"{type(exc).__name__}: {' '.join(str(exc).strip().splitlines()[:3])}"


def read_plan_file(path: str, model: nn.Module, world_size: int) -> Plan:
    """The plan in `path`, checked against the model (on meta) and the pool it is to run on."""
    try:
        plan = Plan.from_file(path)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise UserError(
            "planner.plan_file",
            path,
            f"is not a plan JSON ({_why_not_a_plan(exc)[:300]})",
            "write it with `osdp-platform plan RECIPE --out plan.json` and edit that",
        ) from None
    if plan.structure_hash != structure_hash(model):
        raise UserError(
            "planner.plan_file",
            path,
            f"was made for another model (structure hash {plan.structure_hash}, this model {structure_hash(model)})",
            "re-plan for this model",
        )
    if plan.world_size != world_size:
        raise UserError(
            "planner.plan_file",
            path,
            f"is for {plan.world_size} workers, the pool has {world_size}",
            "match hardware.nodes x workers_per_node to the plan",
        )
    return plan


def manual_choice(model: nn.Module, req: PlanRequest, ctx: Context) -> Choice:
    """The plan file's choice for every unit, checked against the model, the pool and the recipe, and
    evaluated as the search would evaluate its own."""
    if req.plan_file is None:
        raise UserError("planner.plan_file", None, "the manual planner needs a plan file", "set planner.plan_file")
    plan = read_plan_file(req.plan_file, model, req.world_size)
    units = [u.name for u in ctx.profile.units]
    if sorted(u.name for u in plan.units) != sorted(units):
        raise UserError(
            "planner.plan_file",
            req.plan_file,
            f"names units {[u.name for u in plan.units]}, this model's units are {units}",
            "start the file from a plan made for this model",
        )
    allowed = unit_option_lists(ctx, req)
    options = {u.name: Option.of(u) for u in plan.units}
    for name, option in options.items():
        if option not in allowed[name]:
            raise UserError(
                "planner.plan_file",
                req.plan_file,
                f"unit {name}: {option.strategy} over {option.shard_group_size} rank(s), split {option.split}, "
                f"checkpoint {option.checkpoint} is not a choice this unit has on this pool",
                f"use one of: {', '.join(_option_text(o) for o in allowed[name] if not o.checkpoint)} "
                f"(checkpoint {'true or false' if any(o.checkpoint for o in allowed[name]) else 'false'})",
            )
    _check_batch(plan, req)
    evaluation = evaluate(ctx, options, plan.micro_batch_size, plan.grad_accum_steps)
    if evaluation.peak_bytes > req.usable_memory_bytes:
        raise UserError(
            "planner.plan_file",
            req.plan_file,
            f"peaks at {evaluation.peak_bytes / 2**20:.1f} MiB per device, over the "
            f"{req.usable_memory_bytes / 2**20:.1f} MiB usable of the budget ({req.budget_key} = {req.budget_value})",
            "lower micro_batch_size in the file (raising grad_accum_steps), shard or checkpoint more units, or plan "
            "with planner.name=osdp",
        )
    return Choice(options, plan.micro_batch_size, plan.grad_accum_steps, evaluation)


def _option_text(option: Option) -> str:
    return f"{option.strategy}/{option.shard_group_size}/split {option.split}"


def _check_batch(plan: Plan, req: PlanRequest) -> None:
    """A plan file carries its own batch; where the recipe fixes one too, the two must agree (one of them
    would otherwise be ignored without a word)."""
    if req.micro_batch_size is not None and plan.micro_batch_size != req.micro_batch_size:
        raise UserError(
            "train.micro_batch_size",
            req.micro_batch_size,
            f"differs from the plan file's micro_batch_size {plan.micro_batch_size} ({req.plan_file})",
            f"set train.micro_batch_size={plan.micro_batch_size} or auto (the plan's), or edit the plan file",
        )
    if req.global_batch_size is not None and plan.global_batch_size != req.global_batch_size:
        raise UserError(
            "train.global_batch_size",
            req.global_batch_size,
            f"differs from the plan file's {plan.micro_batch_size} x {plan.grad_accum_steps} x {plan.world_size} "
            f"= {plan.global_batch_size} (micro batch x accumulation x workers, {req.plan_file})",
            f"set train.global_batch_size={plan.global_batch_size} or null, or edit the plan file",
        )
