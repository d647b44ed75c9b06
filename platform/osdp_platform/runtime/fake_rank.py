"""Stand in for one rank of an N-rank job inside this process: fake process group + fake tensors.

FSDP2 runs its real code paths (sharding, all-gather buffers, resharding, reduce-scatter) while no
tensor holds memory and no collective moves data, so torch's memory tracker reports what that rank
would hold. This is how the cost model's memory predictions are checked on a machine without the pool.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from osdp_planners.fake_build import build_fake
from osdp_planners.plan import Plan
from osdp_planners.torch_private import FakeTensorMode, register_fake_backend
from osdp_platform.runtime.apply import Meshes, apply_plan
from osdp_platform.runtime.memory import peak_snapshot, tracking
from osdp_platform.runtime.step import train_step


@dataclass(frozen=True)
class FakeRankMemory:
    peak_bytes: int
    breakdown: dict[str, int]  # tracker category -> bytes at the peak


def measure_fake_rank(
    build: Callable[[], nn.Module],
    plan: Plan,
    vocab_size: int,
    rank: int = 0,
    iterations: int = 2,
    optimizer: str = "adamw",
) -> FakeRankMemory:
    """Peak memory of `rank` for one steady-state training step under `plan` (step 2 onwards)."""
    register_fake_backend()
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=dist.HashStore())
    try:
        meshes = Meshes("cpu", plan.world_size, {})
        for g in {u.shard_group_size for u in plan.units} | {plan.world_size}:
            meshes.for_group(g)  # meshes must exist before fake mode
        with FakeTensorMode():
            model = build_fake(build)
            apply_plan(model, plan, "cpu", meshes=meshes)
            opt_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
            opt = opt_cls(model.parameters(), lr=1e-3)
            x = torch.randint(0, vocab_size, (plan.micro_batch_size, plan.seq_len))
            micro_batches = [(x, x)] * plan.grad_accum_steps
            # The steps before the measured one (FSDP's lazy init, the optimizer's first state) run without
            # the tracker: it would only slow them, and the measured step's tracker starts afresh anyway (its
            # peak is a running maximum), seeing what they left through track_external.
            for _ in range(iterations - 1):
                train_step(model, opt, micro_batches, plan.grad_accum_steps)
            with tracking(model, opt) as tracker:
                train_step(model, opt, micro_batches, plan.grad_accum_steps)
            snap = peak_snapshot(tracker)
            return FakeRankMemory(snap.pop("Total"), snap)
    finally:
        dist.destroy_process_group()
