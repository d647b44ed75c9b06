"""Build a sharded model without any rank ever holding it whole: meta device, plan, `to_empty`, then init.

A worker builds the model with its parameters on meta (no memory), applies the plan (split,
checkpoint, `fully_shard`), allocates only its own shards with `to_empty`, and then initialises.
DTensor random ops would not reproduce a full tensor's random stream, so the initialiser runs
instead on a second, unsplit meta copy of the model (the *reference*), one sharding unit at a time:
a unit's parameters are allocated in full, on the device the model trains on, when the initialiser
first reaches one of its modules, handed to the live model (each rank keeps its own rows of each
slice) after the last one, and dropped again. The RNG is drawn in the order a single process
initialising the whole model on that device draws it, so the weights equal that model's whatever
the plan and world size, and a rank holds at most its shards plus one unit in full (tied modules
are one unit: GPT-2's embedding and head). On a GPU the values come from its own generator, which
every rank seeds alike. Drawn on CPU instead, each rank of 8 spent 42 s building a 7B model before
its first step (a 2-core host).

The initialiser is the model's own, called once per module (an *init protocol*):
- `model.init_module(module)`, in module order (parents first): the zoo's, or any user model's;
- a Hugging Face `PreTrainedModel`'s `_init_weights(module)`, children first, as `transformers` applies it.
It may touch the parameters and buffers of `module`'s subtree inside `module`'s own sharding unit
(GPT-2's attention rescales its child `c_proj`). Every module is visited once, a tied head too (its
draw is the one that stays, as in `transformers`' own initialisation). Every parameter starts as
NaN and is checked once initialised, so one the initialiser missed is an error, not garbage. A model
without a protocol is built whole on CPU by every rank from its own constructor (see models.py).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from osdp_planners.split import to_split_names
from osdp_planners.torch_private import FakeTensor
from osdp_planners.units import ROOT, find_units

if TYPE_CHECKING:
    from transformers import PreTrainedModel

UNIT_TRACE_SEQ = 8  # units here only bound what is allocated at once: any length the model accepts finds them
Emit = Callable[[dict[str, torch.Tensor]], None]  # full parameters of one finished unit, by unsplit name


class UninitialisedParameter(RuntimeError):
    """The model's initialiser left a parameter unset: training from it would start from garbage."""


@dataclass(frozen=True)
class InitProtocol:
    init_module: Callable[[nn.Module], None]
    children_first: bool  # transformers applies _init_weights children first (nn.Module.apply order)


def _hf_pretrained() -> "type[PreTrainedModel] | None":
    import sys

    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _hf_initialiser(model: "PreTrainedModel", pretrained: "type[PreTrainedModel]") -> Callable[[nn.Module], None]:
    """Each module initialised by its nearest enclosing PreTrainedModel (a composite model's parts differ)."""
    owner: dict[int, PreTrainedModel] = {}

    def walk(module: nn.Module, current: "PreTrainedModel") -> None:
        current = module if isinstance(module, pretrained) else current
        owner[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(model, model)
    return lambda module: owner[id(module)]._init_weights(module)


def init_protocol(model: nn.Module) -> InitProtocol | None:
    """How `model` initialises itself one module at a time, or None when it cannot (built whole instead)."""
    pretrained = _hf_pretrained()
    if pretrained is not None and isinstance(model, pretrained):
        return InitProtocol(_hf_initialiser(model, pretrained), children_first=True)
    init_module = getattr(model, "init_module", None)
    if callable(init_module):
        return InitProtocol(init_module, children_first=False)
    return None


def _visit_order(model: nn.Module, children_first: bool) -> Iterator[tuple[str, nn.Module]]:
    def walk(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        if not children_first:
            yield prefix, module
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)
        if children_first:
            yield prefix, module

    return walk("", model)


@dataclass
class _Unit:
    """One sharding unit of the reference: its parameters (by id), in full only while being initialised."""

    params: list[nn.Parameter]
    last_visit: int = -1
    full: dict[int, nn.Parameter] = field(default_factory=dict)


@dataclass
class _Walk:
    emit: Emit | None
    device: torch.device  # where a unit is drawn in full
    names: dict[int, str]  # parameter id -> its (first) name
    owners: dict[int, list[tuple[nn.Module, str]]]  # parameter id -> every (module, attribute) holding it

    def materialise(self, unit: _Unit, params: list[nn.Parameter]) -> None:
        """Give meta parameters full storage (NaN), in every module that holds them (tied stay tied)."""
        for p in params:
            if not p.is_meta or id(p) in unit.full:
                continue
            full = nn.Parameter(
                torch.full(p.shape, float("nan"), dtype=p.dtype, device=self.device), requires_grad=p.requires_grad
            )
            unit.full[id(p)] = full
            for module, attr in self.owners[id(p)]:
                module._parameters[attr] = full

    def finish(self, unit: _Unit) -> None:
        """Check the unit's parameters, hand them out and put the meta ones back (the full copy is freed)."""
        values = {self.names[id(p)]: unit.full.get(id(p), p) for p in unit.params}
        for name, value in values.items():
            _check_set(name, value)
        if self.emit is not None and unit.full:
            self.emit({name: v.detach() for name, v in values.items()})
        for p in unit.params:
            if id(p) in unit.full:
                for module, attr in self.owners[id(p)]:
                    module._parameters[attr] = p
        unit.full.clear()


def _check_set(name: str, value: torch.Tensor) -> None:
    if isinstance(value, FakeTensor) or not value.is_floating_point() or value.is_meta:
        return  # fake tensors (planning) have no values to check
    if torch.isnan(value).any():
        raise UninitialisedParameter(
            f"{name}: the model's initialiser did not set it (init_module / _init_weights must cover every "
            "parameter of a module's subtree)"
        )


def _units(model: nn.Module) -> tuple[list[_Unit], dict[str, int]]:
    """The reference's sharding units as parameter lists, and module path -> index of the unit it lies in
    (paths outside every unit, the containers above them, are absent: their own parameters are the root's)."""
    units: list[_Unit] = []
    unit_of: dict[str, int] = {}
    owned: set[int] = set()
    for unit in find_units(model, UNIT_TRACE_SEQ):
        if unit.name == ROOT:
            continue
        params: list[nn.Parameter] = []
        for path in unit.modules:
            for sub_path, _ in model.get_submodule(path).named_modules(prefix=path):
                unit_of.setdefault(sub_path, len(units))  # nested units come first and keep their modules
            params += [p for p in model.get_submodule(path).parameters() if id(p) not in owned]
            owned |= {id(p) for p in params}
        units.append(_Unit(list({id(p): p for p in params}.values())))
    return units, unit_of


@torch.no_grad()
def initialize(
    model: nn.Module, protocol: InitProtocol, emit: Emit | None = None, device: str | torch.device = "cpu"
) -> None:
    """Run the init protocol over `model` module by module.

    Parameters already allocated are initialised in place (a single-process build). Meta parameters
    are allocated on `device` one unit at a time and passed to `emit` by unsplit name once the unit is done.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    for p in model.parameters():
        if not p.is_meta and p.is_floating_point():
            p.fill_(float("nan"))
    units, unit_of = _units(model)
    order = list(_visit_order(model, protocol.children_first))
    for i, (path, _) in enumerate(order):
        if path in unit_of:
            units[unit_of[path]].last_visit = i
    in_units = {id(p) for u in units for p in u.params}
    root = _Unit([p for p in model.parameters() if id(p) not in in_units])
    walk = _Walk(emit, torch.device(device), names, owners)
    for i, (path, module) in enumerate(order):
        unit = units[unit_of[path]] if path in unit_of else root
        walk.materialise(unit, unit.params if unit is not root else list(module.parameters(recurse=False)))
        protocol.init_module(module)
        if unit is not root and unit.last_visit == i:
            walk.finish(unit)
    walk.finish(root)


def scatter_into(live: nn.Module) -> Emit:
    """An `emit` that copies full unsplit parameters into `live`'s shards (each rank keeps its own rows)."""
    targets = dict(live.named_parameters())

    def emit(full: dict[str, torch.Tensor]) -> None:
        for name, value in to_split_names(live, full).items():
            target = targets[name]
            value = value.to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:
                target.copy_(value)

    return emit
