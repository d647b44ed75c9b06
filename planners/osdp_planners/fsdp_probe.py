"""What FSDP2 adds to one GPU rank's compute: copies into its all-gather buffers and out of its
reduce-scatter buffers, and the casts of its mixed-precision policy. They run on the compute stream,
so no overlap hides them (the collectives' own time is the time model's link model).

One rank of the pool is run in this process under the fake process group: collectives move nothing,
so a sharded module's forward+backward over the plain one's is FSDP2's own work. It is measured per
uniform strategy at both timing batches and charged per parameter byte of a unit, since the copies
and casts grow with the unit's size (without a measurement, nothing), at the micro batch: its host
work (hooks, launches) hides behind the compute of a larger batch (on an H200, a chain of 7b
attention blocks under ZeRO-2 added 2.7 ms a block at batch 1 and 0.5 ms at batch 4). A model that fits the
device is measured whole and charged per byte; a larger one on a chain of copies of its largest
repeated block (block_probe), each copy a unit of its own, as neighbouring blocks are in the model.
"""

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from osdp_planners.comm_probe import STRATEGIES, probe_meshes, shard_uniform
from osdp_planners.compute_probe import REPEATS, TIMING_BATCHES, forward_loss, sync
from osdp_planners.profile import Linear1
from osdp_planners.runtime import mp_policy
from osdp_planners.torch_private import register_fake_backend
from osdp_planners.units import ROOT, find_units

Sharded = Callable[[str, dict[str, DeviceMesh]], nn.Module]  # strategy, meshes -> a sharded module
Run = Callable[[nn.Module, int], None]  # forward+backward of a module at a timing batch


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
    """What FSDP2 added to one module's forward+backward under a strategy at each timing batch, and the
    module's parameter bytes."""

    seconds: dict[int, float]
    nbytes: int


def added_costs(
    sharded: Sharded, run: Run, device: torch.device, world: int, plain_s: dict[int, float]
) -> dict[str, Added]:
    """Seconds each uniform strategy adds to `run` over `plain_s` at each timing batch, for rank 0 of
    `world`; `sharded` builds the module (fp32 master weights) under a strategy's meshes."""
    costs = {}
    with _fake_rank(world, device) as meshes:
        for strategy in STRATEGIES:
            module = sharded(strategy, meshes)
            nbytes = sum(p.numel() * p.element_size() for p in module.parameters())  # a DTensor's numel is global
            seconds = {b: max(median_pass(partial(run, module, b), device) - plain_s[b], 0.0) for b in TIMING_BATCHES}
            costs[strategy] = Added(seconds, nbytes)
            del module
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return costs


def per_byte(added: dict[str, Added]) -> dict[str, Linear1]:
    """Each strategy's seconds per byte as a line through its two timing batches."""
    b1, b2 = TIMING_BATCHES
    return {s: Linear1.fit(a.seconds[b1] / a.nbytes, a.seconds[b2] / a.nbytes, b1, b2) for s, a in added.items()}


def measure_fsdp_costs(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    world: int,
    precision: str,
    plain_s: dict[int, float],
) -> dict[str, Linear1]:
    """The whole model under each uniform strategy against `plain_s` (its plain forward+backward at each
    timing batch)."""
    inputs = {b: torch.randint(0, vocab_size, (b, seq_len), device=device) for b in TIMING_BATCHES}

    def sharded(strategy: str, meshes: dict[str, DeviceMesh]) -> nn.Module:
        model = build(str(device))
        units = [[model.get_submodule(m) for m in u.modules] for u in find_units(model, seq_len) if u.name != ROOT]
        return shard_uniform(model, units, strategy, meshes, precision)

    return per_byte(added_costs(sharded, lambda m, b: forward_loss(m, inputs[b]).backward(), device, world, plain_s))


class Chain(nn.Module):
    """Copies of one block called in turn on the same inputs: block_probe's stand-in for a model's run of
    blocks. FSDP2 copies for the next unit while the current one computes, and the root's once-a-step
    work is shared by the copies; a block alone has neither (on an H200 the 7b attention block alone
    added 2.8 ms at batch 1, where a whole 7b ZeRO-2 step added 0.4 ms a block)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args: object, **kwargs: object) -> list[object]:
        return [block(*args, **kwargs) for block in self.blocks]


def shard_chain(chain: Chain, strategy: str, meshes: dict[str, DeviceMesh], precision: str) -> Chain:
    """Each block of `chain` an FSDP2 unit under a uniform strategy, the chain the (empty) root."""
    mesh = meshes["ddp" if strategy == "ddp" else "zero"]
    policy = mp_policy(precision)
    for block in chain.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=strategy == "zero3", mp_policy=policy)
    fully_shard(chain, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return chain
