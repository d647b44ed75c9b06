"""What FSDP2 adds to one GPU rank's compute: copies into its all-gather buffers and out of its
reduce-scatter buffers, the casts of its mixed-precision policy, and its hooks on the host. They run
on the compute stream or hold it up, so no overlap hides them (the collectives' own time is the time
model's link model).

One rank of the pool is run in this process under the fake process group: collectives move nothing,
so a sharded module's forward+backward over the plain one's is FSDP2's own work. It is measured per
uniform strategy at both timing batches and charged per parameter byte of a unit, since the copies
and casts grow with the unit's size (without a measurement, nothing), at the micro batch: its host
work hides behind the compute of a larger batch (on an H200, a chain of 7b attention blocks under
ZeRO-2 added 2.7 ms a block at batch 1 and 0.5 ms at batch 4). The same module with every splittable
Linear a unit of its own, as an operator split's slices are, gives what one more unit costs. A model
that fits the device is measured whole; a larger one on a chain of copies of one of its layers
(block_probe). The optimizer then steps the sharded module: what its DTensors add over the plain
rate per parameter is charged per tensor, as comm_probe measures it on CPU pools.
"""

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from osdp_planners.comm_probe import STRATEGIES, probe_meshes, shard_uniform
from osdp_planners.compute_probe import REPEATS, MeasuredTimes, forward_loss, median_step, sync
from osdp_planners.profile import Linear1
from osdp_planners.runtime import make_optimizer
from osdp_planners.torch_private import register_fake_backend
from osdp_planners.units import ROOT, find_units

Sharded = Callable[[str, dict[str, DeviceMesh], bool], nn.Module]  # strategy, meshes, finer -> a sharded module
Run = Callable[[nn.Module, int], None]  # forward+backward of a module at a timing batch
Call = tuple[tuple[Any, ...], dict[str, Any]]  # a module's positional and keyword arguments


def median_pass(run: Callable[[], None], device: torch.device) -> float:
    times = []
    for i in range(REPEATS + 1):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        if i:  # the first pass builds FSDP2's lazy state
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def _fake_rank(world: int, device: torch.device) -> Iterator[dict[str, DeviceMesh]]:
    """Rank 0 of `world` under the fake process group (unless a group exists), with the probe's meshes."""
    register_fake_backend()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", rank=0, world_size=world, store=dist.HashStore())
    try:
        yield probe_meshes(world, device.type)
    finally:
        if own_group:
            dist.destroy_process_group()


@dataclass(frozen=True)
class Added:
    """What FSDP2 added to one module's forward+backward under a strategy at each timing batch, with the
    module's parameter bytes; what each further unit added when its splittable Linears were units of
    their own (as an operator split's slices are); and its optimizer step over the rank's shards
    (seconds, tensors, elements)."""

    seconds: dict[int, float]
    nbytes: int
    unit_seconds: dict[int, float]
    optimizer_s: float
    tensors: int
    local_params: int


def finer(units: list[list[nn.Module]], linears: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """`units` sharded as a split shards them (runtime.apply): each of their splittable Linears
    (`linears[i]`: unit i's) a unit of its own, then each unit over what it has left, if anything
    (a Linear that is one of a unit's modules leaves it)."""
    own = [[lin] for lins in linears for lin in lins]
    taken = {id(p) for (lin,) in own for p in lin.parameters()}
    rest = [[m for m in unit if all(m is not lin for (lin,) in own)] for unit in units]
    return own + [unit for unit in rest if any(id(p) not in taken for m in unit for p in m.parameters())]


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _fsdp_modules(module: nn.Module) -> int:
    return sum(isinstance(m, FSDPModule) for m in module.modules())


def added_costs(
    sharded: Sharded, run: Run, device: torch.device, world: int, plain_s: dict[int, float], optimizer: str
) -> dict[str, Added]:
    """Seconds each uniform strategy adds to `run` over `plain_s` at each batch it was timed at, for rank 0
    of `world`, and per further unit when `sharded` (which builds the module, fp32 master weights, under a
    strategy's meshes) makes finer units; the runtime's `optimizer` steps the gradients the runs left."""
    costs, batches = {}, sorted(plain_s)
    with _fake_rank(world, device) as meshes:
        for strategy in STRATEGIES:
            fine = sharded(strategy, meshes, True)
            fine_s = {b: median_pass(partial(run, fine, b), device) for b in batches}
            fine_units = _fsdp_modules(fine)
            del fine
            module = sharded(strategy, meshes, False)
            params = list(module.parameters())
            nbytes = sum(p.numel() * p.element_size() for p in params)  # a DTensor's numel is global
            whole_s = {b: median_pass(partial(run, module, b), device) for b in batches}
            further = fine_units - _fsdp_modules(module)
            costs[strategy] = Added(
                {b: max(whole_s[b] - plain_s[b], 0.0) for b in batches},
                nbytes,
                {b: max(fine_s[b] - whole_s[b], 0.0) / further if further else 0.0 for b in batches},
                median_step(make_optimizer(params, optimizer, device.type), device),
                len(params),
                sum(_local_numel(p) for p in params),
            )
            del module, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return costs


def charge(times: MeasuredTimes, added: dict[str, Added]) -> MeasuredTimes:
    """`times` with what FSDP2 adds: each strategy's seconds per byte and per further unit, lines through
    the two batches `times` was timed at, and what each of its DTensors adds to the optimizer step over
    `times`' rate per parameter."""
    b1, b2 = times.batches
    rate = times.optimizer_s_per_param
    return dataclasses.replace(
        times,
        fsdp_s_per_byte={
            s: Linear1.fit(a.seconds[b1] / a.nbytes, a.seconds[b2] / a.nbytes, b1, b2) for s, a in added.items()
        },
        fsdp_s_per_unit={s: Linear1.fit(a.unit_seconds[b1], a.unit_seconds[b2], b1, b2) for s, a in added.items()},
        optimizer_tensor_cost_s={
            s: max(a.optimizer_s - rate * a.local_params, 0.0) / max(a.tensors, 1) for s, a in added.items()
        },
    )


def measure_fsdp_costs(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    world: int,
    precision: str,
    plain_s: dict[int, float],
    optimizer: str,
) -> dict[str, Added]:
    """The whole model under each uniform strategy against `plain_s` (its plain forward+backward at each
    batch timed)."""
    inputs = {b: torch.randint(0, vocab_size, (b, seq_len), device=device) for b in plain_s}

    def sharded(strategy: str, meshes: dict[str, DeviceMesh], fine: bool) -> nn.Module:
        model = build(str(device))
        found = [u for u in find_units(model, seq_len) if u.name != ROOT]
        units = [[model.get_submodule(m) for m in u.modules] for u in found]
        if fine:
            units = finer(units, [[model.get_submodule(p) for p in u.linears] for u in found])
        return shard_uniform(model, units, strategy, meshes, precision)

    return added_costs(sharded, lambda m, b: forward_loss(m, inputs[b]).backward(), device, world, plain_s, optimizer)


class Chain(nn.Module):
    """Copies of one layer of a model (its repeating units: a decoder's attention and MLP), called in
    turn, each module on the inputs it gets in the model: block_probe's stand-in for a model's run of
    layers. FSDP2 copies for the next unit while the current one computes, its host work for a small
    unit hides behind a large unit's kernels, and the root's once-a-step work is shared; one block
    alone, or copies of one kind of block, show none of this. On an H200 at batch 1 under ZeRO-2, a
    chain of 7b attention blocks added 2.7 ms a block and one of MLPs 1.2 ms, where the whole 7b step
    ran 2.8 ms a layer over its plain blocks' time."""

    def __init__(
        self, copies: list[list[nn.Module]], units: list[list[nn.Module]], linears: list[list[nn.Module]]
    ) -> None:
        """`copies[i]`: the modules copy i of the layer calls, in order; `units`: the modules of each
        FSDP2 unit of all copies (a unit may sit inside a called module); `linears`: each unit's
        splittable Linears."""
        super().__init__()
        self.called = nn.ModuleList(m for modules in copies for m in modules)
        self.units, self.linears = units, linears

    def forward(self, calls: list[Call]) -> list[object]:
        """Every copy of the layer, its k-th called module on `calls[k]`."""
        every = calls * (len(self.called) // len(calls))
        return [m(*args, **kwargs) for m, (args, kwargs) in zip(self.called, every, strict=True)]
