"""Apply a plan to a live model with FSDP2, unit by unit, and check the result matches the plan.

Every strategy is one `fully_shard` call with its own mesh and resharding setting:
ZeRO-3 = 1-D mesh over all ranks, reshard after forward; ZeRO-2-like = same mesh, keep gathered;
HSDP(g) = 2-D mesh (world/g replicas x g shards), reshard; DP = 2-D mesh (world x 1), keep gathered.
The root takes every parameter no unit claimed; its strategy sets its mesh, and it stays gathered
from forward to backward whatever the strategy, as FSDP2 does by default for the root.

A world of one shards nothing, so no unit is handed to FSDP2: on one H200 its copies and casts made a
step 7% slower than the plain module under autocast (llama 1b, seq 2048: 0.183 s against 0.171 s).
There the model computes under `torch.autocast` in the plan's compute dtype instead of FSDP2's
mixed-precision policy, as a hand-written loop would.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from osdp_planners.plan import Plan, Strategy, UnitPlan
from osdp_planners.runtime import compile_units, compute_dtype, mp_policy
from osdp_planners.split import SplitLinear, split_linear_in
from osdp_planners.torch_private import checkpoint, composable_registry, reshards_after_forward
from osdp_planners.units import find_units, structure_hash


class PlanMismatch(RuntimeError):
    """The live model does not execute the plan it was given; training must not start."""


@dataclass
class Meshes:
    """One DeviceMesh per shard-group size, created once (each creates process groups)."""

    device_type: str
    world_size: int
    _cache: dict[int, DeviceMesh]

    def for_group(self, g: int) -> DeviceMesh:
        if g not in self._cache:
            if g == self.world_size:
                mesh = init_device_mesh(self.device_type, (g,), mesh_dim_names=("shard",))
            else:
                mesh = init_device_mesh(
                    self.device_type, (self.world_size // g, g), mesh_dim_names=("replicate", "shard")
                )
            self._cache[g] = mesh
        return self._cache[g]


class _ShardArgs(TypedDict):
    """`fully_shard`'s keywords for one unit."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy


def _reshard(unit: UnitPlan) -> bool:
    return unit.strategy in (Strategy.ZERO3, Strategy.HSDP)


def apply_plan(model: nn.Module, plan: Plan, device_type: str, meshes: Meshes | None = None) -> Meshes:
    """Split, checkpoint-wrap and shard every unit as the plan says; the root takes what is left.

    A unit whose parameters all went to the slices of its split Linears (an MLP of Linears, a Linear
    head) has nothing left for a `fully_shard` of its own: only its slices are sharded.
    Pass `meshes` to reuse process groups across models (each new mesh creates groups).
    """
    if structure_hash(model) != plan.structure_hash:
        raise PlanMismatch(
            f"the plan was made for a model with structure hash {plan.structure_hash}, this model has "
            f"{structure_hash(model)}: re-plan for this model"
        )
    linears = {u.name: u.linears for u in find_units(model, plan.seq_len)}
    if set(linears) != {u.name for u in plan.units}:
        raise PlanMismatch(
            f"plan units {sorted(u.name for u in plan.units)} are not this model's units "
            f"{sorted(linears)}: re-plan for this model"
        )
    meshes = meshes or Meshes(device_type, plan.world_size, {})
    if plan.world_size == 1:
        _apply_unsharded(model, plan, linears, device_type)
    else:
        _apply_sharded(model, plan, linears, meshes)
    if plan.compile:
        compile_units(model, [m for u in plan.units if u.modules != [""] for m in u.modules])
    return meshes


def _apply_sharded(model: nn.Module, plan: Plan, linears: dict[str, tuple[str, ...]], meshes: Meshes) -> None:
    """Split, checkpoint and `fully_shard` every unit; the root over what is left."""
    mp = mp_policy(plan.precision)
    root_unit = None
    for unit in plan.units:
        if unit.modules == [""]:
            root_unit = unit
            continue
        kwargs: _ShardArgs = {
            "mesh": meshes.for_group(unit.shard_group_size),
            "reshard_after_forward": _reshard(unit),
            "mp_policy": mp,
        }
        if unit.split > 1:
            for path in linears[unit.name]:
                split = split_linear_in(model, path, unit.split)
                for piece in split.slices:
                    fully_shard(piece, **kwargs)
        modules = [model.get_submodule(m) for m in unit.modules]
        if unit.checkpoint:
            for module in modules:
                checkpoint(module)
        if _unsharded(modules):
            fully_shard(modules if len(modules) > 1 else modules[0], **kwargs)
    # the root stays gathered from its forward to its backward whatever its strategy (FSDP2's default):
    # its backward all-gather would hang on the model's output, which a user's output object can hide
    root_g = root_unit.shard_group_size if root_unit else plan.world_size
    fully_shard(model, mesh=meshes.for_group(root_g), reshard_after_forward=False, mp_policy=mp)
    verify_applied(model, plan, linears)


def _apply_unsharded(model: nn.Module, plan: Plan, linears: dict[str, tuple[str, ...]], device_type: str) -> None:
    """A world of one: split and checkpoint as the plan says, compute under autocast, no FSDP2."""
    for unit in (u for u in plan.units if u.modules != [""]):
        for path in linears[unit.name] if unit.split > 1 else ():
            split_linear_in(model, path, unit.split)
        for module in [model.get_submodule(m) for m in unit.modules] if unit.checkpoint else []:
            checkpoint(module)
    dtype = compute_dtype(plan.precision)
    if dtype != torch.float32:
        autocast_forward(model, device_type, dtype)
    verify_applied(model, plan, linears)


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run `model`'s forward under autocast to `dtype` (the loss and backward stay outside, as in a
    hand-written loop); the context closes even when the forward raises. Embeddings, which autocast
    leaves in fp32, hand their output on in `dtype`: activations stay in the compute dtype as under
    FSDP2's policy, which the memory model counts (fp32 residuals made a tiny llama's peak 2% larger)."""
    active: list[torch.autocast] = []

    def enter(_module: nn.Module, _args: object) -> None:
        active.append(torch.autocast(device_type, dtype=dtype))
        active[-1].__enter__()

    def leave(_module: nn.Module, _args: object, _out: object) -> None:
        active.pop().__exit__(None, None, None)

    def in_compute_dtype(_module: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        return out.to(dtype) if out.is_floating_point() else out

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(in_compute_dtype)
        if isinstance(module, nn.RMSNorm) and module.weight is not None:
            module.forward = _rms_norm_in_input_dtype(module)  # type: ignore[method-assign,assignment]


def _rms_norm_in_input_dtype(norm: nn.RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """RMSNorm with its weight cast to the input's dtype, as FSDP2's policy computes it. Autocast leaves
    rms_norm alone, and a bf16 input with an fp32 weight misses the fused kernel: on one H200 the
    unfused norms made the llama 1b's step (micro 4, seq 2048) 0.178 s against 0.157 s fused."""
    shape = tuple(norm.normalized_shape)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, norm.weight.to(x.dtype), norm.eps)

    return forward


def _unsharded(modules: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters of `modules` that no `fully_shard` has taken yet (nested units and slices took theirs)."""
    return [p for m in modules for p in m.parameters() if not isinstance(p, DTensor)]


def _check_sharding(
    modules: list[nn.Module], unit: UnitPlan, world_size: int, what: str, reshard: bool | None = None
) -> None:
    """One fully_shard call over `modules`: its parameters' mesh and its resharding match the unit."""
    if not all(isinstance(m, FSDPModule) for m in modules):
        raise PlanMismatch(f"{what} is not sharded by FSDP2")
    own = [p for m in modules for p in _own_params(m) if isinstance(p, DTensor)]
    if not own:
        raise PlanMismatch(f"{what} holds no parameters under FSDP2")
    mesh = own[0].device_mesh  # 1-D over all ranks (ZeRO), or 2-D replicas x shards (HSDP, DP)
    shard = mesh.size(mesh.ndim - 1)
    replicate = mesh.size(0) if mesh.ndim == 2 else 1
    if (shard, replicate) != (unit.shard_group_size, world_size // unit.shard_group_size):
        raise PlanMismatch(
            f"{what}: mesh shards over {shard} x replicates {replicate}, plan says "
            f"{unit.strategy} with group {unit.shard_group_size}"
        )
    if reshards_after_forward(modules[0]) != (_reshard(unit) if reshard is None else reshard):
        raise PlanMismatch(f"{what}: reshard_after_forward does not match strategy {unit.strategy}")


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of `module` that no FSDP2 unit nested in it (slices, inner units) holds."""
    inner = {
        id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule) for p in sub.parameters()
    }
    return [p for p in module.parameters() if id(p) not in inner]


def _held_inside(module: nn.Module) -> bool:
    """Every parameter of `module` belongs to an FSDP2 unit nested in it."""
    return not _own_params(module)


def verify_applied(model: nn.Module, plan: Plan, linears: dict[str, tuple[str, ...]]) -> None:
    """Compare the live model with the plan: mesh, resharding, split and checkpoint of every unit
    (a world of one: nothing is sharded)."""
    sharded = plan.world_size > 1
    if not sharded and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise PlanMismatch("a world of one shards nothing, but the model holds FSDP2 units")
    for unit in plan.units:
        if unit.modules == [""] and not sharded:
            continue
        if unit.modules == [""]:
            if unit.checkpoint or unit.split > 1:
                raise PlanMismatch("the root unit can be neither checkpointed nor split: re-plan")
            _check_sharding([model], unit, plan.world_size, "the root", reshard=False)
            continue
        modules = [model.get_submodule(path) for path in unit.modules]
        emptied = unit.split > 1 and not isinstance(modules[0], FSDPModule) and all(map(_held_inside, modules))
        if sharded and not emptied:
            _check_sharding(modules, unit, plan.world_size, f"unit {unit.name} ({', '.join(unit.modules)})")
        for module in modules:
            has_ckpt = "checkpoint" in (composable_registry(module) or {})
            if has_ckpt != unit.checkpoint:
                raise PlanMismatch(
                    f"unit {unit.name}: activation checkpointing is {has_ckpt}, plan says {unit.checkpoint}"
                )
        for path in linears[unit.name]:
            live = model.get_submodule(path)
            slices = len(live.slices) if isinstance(live, SplitLinear) else 1
            if slices != unit.split:
                raise PlanMismatch(f"unit {unit.name}: {path} is in {slices} slice(s), plan says {unit.split}")
            if isinstance(live, SplitLinear) and sharded:
                for piece in live.slices:
                    _check_sharding([piece], unit, plan.world_size, f"a slice of {path}")
