"""What FSDP2 adds to one GPU rank's compute: copies into its all-gather buffers and out of its
reduce-scatter buffers, and the casts of its mixed-precision policy. They run on the compute stream,
so no overlap hides them (the collectives' own time is the time model's link model).

One rank of the pool is run in this process under the fake process group: collectives move nothing,
so a uniformly sharded model's forward+backward over the plain model's (compute_probe) is FSDP2's own
work. It is measured per uniform strategy at the larger timing batch and charged per parameter byte
of a unit, since the copies and casts grow with the unit's size (without a measurement, nothing).
"""

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from osdp_planners.comm_probe import STRATEGIES, shard_uniform
from osdp_planners.compute_probe import REPEATS, TIMING_BATCHES, forward_loss, sync
from osdp_planners.torch_private import register_fake_backend
from osdp_planners.units import ROOT, find_units


def _median_pass(model: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    times = []
    for i in range(REPEATS + 1):
        sync(device)
        t0 = time.perf_counter()
        forward_loss(model, x).backward()
        sync(device)
        if i:  # the first pass builds FSDP2's lazy state
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_fsdp_costs(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    world: int,
    precision: str,
    plain_s: float,
) -> dict[str, float]:
    """Seconds per parameter byte that each uniform strategy adds to forward+backward over `plain_s`
    (the plain model's at the larger timing batch), for rank 0 of `world` ranks."""
    register_fake_backend()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("fake", rank=0, world_size=world, store=dist.HashStore())
    try:
        meshes = {
            "ddp": init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard")),
            "zero": init_device_mesh(device.type, (world,), mesh_dim_names=("shard",)),
        }
        x = torch.randint(0, vocab_size, (TIMING_BATCHES[-1], seq_len), device=device)
        costs = {}
        for strategy in STRATEGIES:
            model = build(str(device))
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            units = [[model.get_submodule(m) for m in u.modules] for u in find_units(model, seq_len) if u.name != ROOT]
            shard_uniform(model, units, strategy, meshes, precision)
            costs[strategy] = max(_median_pass(model, x, device) - plain_s, 0.0) / nbytes
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return costs
    finally:
        if own_group:
            dist.destroy_process_group()
