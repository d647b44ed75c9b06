"""Sharding units: the modules a plan assigns strategies to, found from any nn.Module.

A unit is what one `fully_shard` call takes: one module, or a list of modules sharded as one group
(named by its modules joined with '+', siblings of the first written without their parent).
Discovery runs the model's forward once on fake tensors (planners/osdp_planners/trace.py: which modules run, how
often, and which modules are active when each parameter is used) and walks the module tree:

- Passed through, never units: the root; containers without a forward (`ModuleList`, `ModuleDict`);
  modules that never run themselves while their children do (a `Sequential` iterated as a list);
  and, outside blocks, any module holding a container (the body of an HF `*ForCausalLM`, a called
  `Sequential` of blocks). Their own direct parameters and buffers stay with the root.
- Blocks, the children of such containers, are split into their parameter-holding children (a
  container met there is passed through the same way); a block holding parameters directly is also
  a unit itself, nested around its children's units. A child that is not a block is one unit.
- A module that never runs in the forward is never a unit: its parameters go to the unit around it,
  or the root. A module that runs twice is a unit that FSDP2 gathers twice, as the profiler records.
- Modules sharing a parameter (tied embedding and head, shared layers) are one unit; a tie that
  reaches a module outside every unit, or a unit whose parameter is used while none of its modules
  runs (`x @ self.embed.weight.T` in the parent's forward), is left to the root, which FSDP2 keeps
  gathered through the whole forward and backward.
- A module whose output hides its tensors from pytree (a plain object) is not a unit: FSDP2 hooks a
  unit's backward on its output tensors.
- Each FSDP2 unit costs Python time in every step, so a block's child holding only vectors (a norm)
  joins the sibling that runs right after it (or before it, when it runs last): an HF decoder layer
  makes two units, not four. Outside blocks such a holder stays with the root. A unit of several
  modules needs each of them to run exactly once (FSDP2 reshards a group when all have run).

Units are listed in registration order, nested units before the block around them. A Linear is
splittable (see planners/osdp_planners/split.py) when it is a plain `nn.Linear` that runs and whose untied weight
and bias are used only inside its own forward.
"""

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from osdp_planners.trace import ROOT as ROOT  # the root unit's name, re-exported for the units' users
from osdp_planners.trace import CallTrace, trace_structure


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[str, ...]  # module paths ("" is the root module)
    param_count: int
    linears: tuple[str, ...]  # Linear modules an operator split would slice (untied weights only)
    tensor_count: int  # parameter tensors (FSDP2's per-tensor costs scale with it)


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _list_like(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential)


def _holds_container(module: nn.Module) -> bool:
    return any(_list_like(m) for m in module.modules())


def _vectors_only(params: list[nn.Parameter]) -> bool:
    return bool(params) and all(p.dim() <= 1 for p in params)


@dataclass(frozen=True)
class _Candidate:
    path: str
    block: str | None  # the block it was split from (its siblings share it); None outside blocks
    index: int  # registration order


class _Walk:
    """Candidate unit modules, by the rules of the module docstring (paths as `named_modules` gives them)."""

    def __init__(self, model: nn.Module, trace: CallTrace) -> None:
        self.trace = trace
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.seen = {id(model)}
        self.found: list[_Candidate] = []
        for path, child in self.children(model):
            self.outer(child, path)

    def runs(self, module: nn.Module) -> bool:
        return self.trace.runs(self.paths[id(module)])

    def children(self, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """Children not met before that hold parameters and run (themselves or below)."""
        for child in module.children():
            if id(child) in self.seen or not _has_params(child):
                continue
            self.seen.add(id(child))
            if any(self.runs(m) for m in child.modules()):
                yield self.paths[id(child)], child

    def add(self, module: nn.Module, path: str, block: str | None) -> None:
        self.seen |= {id(m) for m in module.modules()}
        self.found.append(_Candidate(path, block, len(self.found)))

    def outer(self, module: nn.Module, path: str) -> None:
        """A module outside blocks: passed through, a container of blocks, or one unit."""
        if _list_like(module):
            for block_path, block in self.children(module):
                self.block(block, block_path)
        elif not _has_forward(module) or not self.runs(module) or (not module._parameters and _holds_container(module)):
            for child_path, child in self.children(module):
                self.outer(child, child_path)
        else:
            self.add(module, path, None)

    def block(self, block: nn.Module, path: str) -> None:
        """An element of a container: its parameter-holding children, then itself if it holds any directly."""
        if _list_like(block) or not _has_forward(block) or not self.runs(block):
            self.outer(block, path)
            return
        for child_path, child in self.children(block):
            self.inside(child, child_path, path)
        if block._parameters:
            self.add(block, path, None)

    def inside(self, module: nn.Module, path: str, block: str) -> None:
        if not _has_forward(module) or not self.runs(module):
            for child_path, child in self.children(module):
                self.inside(child, child_path, block)
        else:
            self.add(module, path, block)


class _Assignment:
    """Groups of candidates (the units to be) and the parameters each holds.

    As FSDP2 does, a unit takes every parameter registered on a module below it, unless a unit
    nested inside takes it first; a parameter registered on modules under two units (a tie, or a
    module shared by two blocks) ties those units; one also registered outside every unit belongs
    to the root.
    """

    def __init__(self, model: nn.Module, trace: CallTrace, candidates: list[_Candidate]) -> None:
        self.trace = trace
        modules = dict(model.named_modules(remove_duplicate=False))
        self.registered: dict[int, list[nn.Module]] = {}  # parameter -> the modules registering it
        for name, p in model.named_parameters(remove_duplicate=False):
            self.registered.setdefault(id(p), []).append(modules[name.rpartition(".")[0]])
        self.params = {id(p): p for p in model.parameters()}
        self.canonical = {id(p): n for n, p in model.named_parameters()}
        self.below = {c.path: {id(m) for m in model.get_submodule(c.path).modules()} for c in candidates}
        self.top = {c.path: id(model.get_submodule(c.path)) for c in candidates}
        self.groups: list[list[_Candidate]] = [[c] for c in candidates]

    def holders(self) -> dict[int, set[int | None]]:
        """Per parameter, the groups of the innermost units above each module registering it (None: none)."""
        alive = [(gi, c.path) for gi, g in enumerate(self.groups) for c in g]

        def holder(module: nn.Module) -> set[int | None]:
            above = [(gi, path) for gi, path in alive if id(module) in self.below[path]]
            inner = {
                gi
                for gi, path in above
                if not any(other != path and self.top[other] in self.below[path] for _, other in above)
            }
            return set(inner) if inner else {None}

        cache: dict[int, set[int | None]] = {}
        out = {}
        for pid, mods in self.registered.items():
            out[pid] = set().union(*(cache.setdefault(id(m), holder(m)) for m in mods))
        return out

    def owned(self) -> list[list[nn.Parameter]]:
        out: list[list[nn.Parameter]] = [[] for _ in self.groups]
        for pid, held in self.holders().items():
            if len(held) == 1 and None not in held:
                out[next(iter(held))].append(self.params[pid])  # type: ignore[index]
        return out

    def _compact(self) -> None:
        self.groups = [g for g in self.groups if g]

    def merge_ties(self) -> None:
        """One group per shared parameter; a parameter also held outside every unit takes its groups to the root."""
        while True:
            tied = next((held for held in self.holders().values() if len(held) > 1), None)
            if tied is None:
                return
            members = sorted(gi for gi in tied if gi is not None)
            if None in tied:
                for gi in members:
                    self.groups[gi] = []
            else:
                for gi in members[1:]:
                    self.groups[members[0]] += self.groups[gi]
                    self.groups[gi] = []
            self._compact()

    def hookable(self, group: list[_Candidate]) -> bool:
        """FSDP2 hooks a unit's backward on the tensors of its output."""
        return not any(c.path in self.trace.opaque for c in group)

    def runs_once_each(self, group: list[_Candidate]) -> bool:
        return all(self.trace.calls.get(c.path, 0) == 1 for c in group)

    def used_outside(self, group: list[_Candidate], params: list[nn.Parameter]) -> bool:
        paths = {c.path for c in group}
        return any(
            not paths.intersection(stack) for p in params for stack in self.trace.uses.get(self.canonical[id(p)], ())
        )

    def settle(self) -> None:
        """Merge ties, then drop groups FSDP2 could not run as units, until nothing changes."""
        while True:
            self.merge_ties()
            owned = self.owned()
            bad = [
                gi
                for gi, g in enumerate(self.groups)
                if not owned[gi]
                or not self.hookable(g)
                or self.used_outside(g, owned[gi])
                or (len(g) > 1 and not self.runs_once_each(g))
                or (len(g) == 1 and g[0].block is None and _vectors_only(owned[gi]))
            ]
            if not bad:
                return
            for gi in bad:
                self.groups[gi] = []
            self._compact()

    def join_vector_holders(self) -> None:
        """A block's child holding only vectors joins the sibling that runs next, else the one before it."""
        owned = self.owned()
        single = [
            gi for gi, g in enumerate(self.groups) if len(g) == 1 and g[0].block is not None and self.runs_once_each(g)
        ]
        targets = [gi for gi in single if not _vectors_only(owned[gi])]
        for gi in single:
            if gi in targets:
                continue
            c = self.groups[gi][0]
            here = self.trace.first[c.path]
            siblings = [
                (self.trace.first[self.groups[t][0].path], t) for t in targets if self.groups[t][0].block == c.block
            ]
            after = [s for s in siblings if s[0] > here]
            before = [s for s in siblings if s[0] < here]
            target = min(after)[1] if after else (max(before)[1] if before else None)
            if target is not None:
                self.groups[target] = self.groups[target] + self.groups[gi]
                self.groups[gi] = []
        self._compact()


def units_of(model: nn.Module, trace: CallTrace) -> list[Unit]:
    """The model's sharding units given one traced forward (see the module docstring)."""
    assignment = _Assignment(model, trace, _Walk(model, trace).found)
    assignment.settle()
    assignment.join_vector_holders()
    owned = assignment.owned()
    order = sorted(range(len(assignment.groups)), key=lambda gi: min(c.index for c in assignment.groups[gi]))
    units = []
    for gi in order:
        mods = [c.path for c in sorted(assignment.groups[gi], key=lambda c: c.index)]
        params = owned[gi]
        units.append(
            Unit(
                _unit_name(mods),
                tuple(mods),
                sum(p.numel() for p in params),
                _splittable(model, trace, mods, {id(p) for p in params}, assignment),
                len(params),
            )
        )
    claimed = {id(p) for ps in owned for p in ps}
    leftover = [p for p in model.parameters() if id(p) not in claimed]
    if leftover:
        units.append(Unit(ROOT, ("",), sum(p.numel() for p in leftover), (), len(leftover)))
    return units


def _unit_name(mods: list[str]) -> str:
    """The modules joined by '+', siblings of the first without their common parent: `h.0.ln_1+attn`."""
    parent = mods[0].rpartition(".")[0]
    rest = [m[len(parent) + 1 :] if parent and m.rpartition(".")[0] == parent else m for m in mods[1:]]
    return "+".join([mods[0], *rest])


def _splittable(
    model: nn.Module, trace: CallTrace, mods: list[str], owned: set[int], assignment: _Assignment
) -> tuple[str, ...]:
    """Plain Linears of the unit that run and whose own, untied tensors only their forward uses."""
    out = []
    for m in mods:
        for n, sub in model.get_submodule(m).named_modules():
            path = f"{m}.{n}" if n else m
            if type(sub) is not nn.Linear or not trace.runs(path):
                continue
            tensors = [t for t in (sub.weight, sub.bias) if t is not None]
            if any(id(t) not in owned or len(assignment.registered[id(t)]) > 1 for t in tensors):
                continue
            if all(path in stack for t in tensors for stack in trace.uses.get(assignment.canonical[id(t)], ())):
                out.append(path)
    return tuple(out)


def find_units(model: nn.Module, seq_len: int, vocab_size: int | None = None) -> list[Unit]:
    """The model's sharding units, from one fake forward on `seq_len` tokens (raises UserError if it fails)."""
    return units_of(model, trace_structure(model, seq_len, vocab_size))


def structure_hash(model: nn.Module) -> str:
    """Identifies a model's parameter structure, so a plan cannot be applied to another model."""
    h = hashlib.sha256()
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
