"""Sharding units: the modules a plan assigns strategies to, found from any nn.Module's structure.

Rule: the blocks of every nn.ModuleList are split into their parameter-holding children (attention,
MLP, ...), a block that holds parameters directly is a unit of its own, and every other
parameter-holding child of a container is one unit. Modules that share a parameter (tied embeddings)
are merged into one unit, because FSDP2 cannot shard one parameter in two units. Parameters no unit
claims stay with the root.
"""

import hashlib
from dataclasses import dataclass

from torch import nn

ROOT = "<root>"


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[str, ...]  # module paths ("" is the root module)
    param_count: int
    linears: tuple[str, ...]  # Linear modules an operator split would slice (untied weights only)
    tensor_count: int  # parameter tensors (FSDP2's per-tensor costs scale with it)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _contains_module_list(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList) for m in module.modules())


def _candidate_paths(module: nn.Module, prefix: str) -> list[str]:
    paths: list[str] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if not _has_params(child):
            continue
        if isinstance(child, nn.ModuleList):
            for idx, block in child.named_children():
                block_path = f"{path}.{idx}"
                paths += [f"{block_path}.{n}" for n, c in block.named_children() if _has_params(c)]
                if any(True for _ in block.parameters(recurse=False)):
                    paths.append(block_path)
        elif _contains_module_list(child):
            paths += _candidate_paths(child, f"{path}.")
        else:
            paths.append(path)
    return paths


def _params_of(model: nn.Module, path: str, owned: set[int]) -> list[nn.Parameter]:
    """Parameters a unit at `path` takes: those below it not already taken by a nested unit."""
    return [p for p in model.get_submodule(path).parameters() if id(p) not in owned]


def find_units(model: nn.Module) -> list[Unit]:
    """The model's sharding units in registration order (nested units before the block that holds them)."""
    paths = _candidate_paths(model, "")
    owned: set[int] = set()
    groups: list[list[str]] = []
    params_by_group: list[set[int]] = []
    for path in paths:
        ids = {id(p) for p in _params_of(model, path, owned)}
        owned |= ids
        groups.append([path])
        params_by_group.append(ids)
    tied = _tied_ids(model)
    merged: list[tuple[list[str], set[int]]] = []
    for mods, ids in zip(groups, params_by_group, strict=True):
        share = [m for m in merged if m[1] & ids or _share_tied(model, m[0], mods, tied)]
        if share:
            share[0][0].extend(mods)
            share[0][1].update(ids)
        else:
            merged.append((mods, set(ids)))
    units = [_make_unit(model, mods, ids, tied) for mods, ids in merged]
    leftover = [p for p in model.parameters() if id(p) not in owned]
    if leftover:
        units.append(Unit(ROOT, ("",), sum(p.numel() for p in leftover), (), len(leftover)))
    return units


def _tied_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _share_tied(model: nn.Module, a: list[str], b: list[str], tied: set[int]) -> bool:
    ids_a = {id(p) for m in a for p in model.get_submodule(m).parameters()} & tied
    ids_b = {id(p) for m in b for p in model.get_submodule(m).parameters()} & tied
    return bool(ids_a & ids_b)


def _make_unit(model: nn.Module, mods: list[str], ids: set[int], tied: set[int]) -> Unit:
    linears = tuple(
        f"{m}.{n}" if n else m
        for m in mods
        for n, sub in model.get_submodule(m).named_modules()
        if isinstance(sub, nn.Linear) and id(sub.weight) in ids and id(sub.weight) not in tied
    )
    params = [p for p in model.parameters() if id(p) in ids]
    return Unit("+".join(mods), tuple(mods), sum(p.numel() for p in params), linears, len(params))


def structure_hash(model: nn.Module) -> str:
    """Identifies a model's parameter structure, so a plan cannot be applied to another model."""
    h = hashlib.sha256()
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
