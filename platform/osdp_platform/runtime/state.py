"""A rank's training state, set up in one place: the Ray Train worker, the tests and the benchmarks
build it with `build_worker_state` and step it with `WorkerState.step`, so what they check and time
is the worker's own setup (seed, sharded build, optimizer, restore, data), not a copy of it.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from osdp_planners.plan import Plan
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.apply import Meshes
from osdp_platform.runtime.data import BatchSampler, Tokens, load_tokens
from osdp_platform.runtime.models import build_sharded
from osdp_platform.runtime.step import Batch, build_optimizer, train_step

# loads a checkpoint into the model and optimizer, returns the step to continue at (checkpoint.restore)
Restore = Callable[[nn.Module, torch.optim.Optimizer], int]


@dataclass
class WorkerState:
    """What one rank trains with, and the step training continues at (0, or a restored checkpoint's)."""

    plan: Plan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    device: torch.device
    first_step: int = 0

    def batches(self, step: int, rank: int, world: int) -> Iterator[Batch]:
        """This rank's micro batches of `step`, drawn when consumed (inside a timed step)."""
        plan = self.plan
        return self.sampler.micro_batches(step, plan.grad_accum_steps, plan.micro_batch_size, rank, world, self.device)

    def step(self, step: int, rank: int, world: int) -> torch.Tensor:
        """One training step on this rank's share of the global batch; this rank's mean loss, detached."""
        return train_step(self.model, self.optimizer, self.batches(step, rank, world), self.plan.grad_accum_steps)


def build_worker_state(
    recipe: Recipe,
    plan: Plan,
    device: torch.device,
    restore: Restore | None = None,
    meshes: Meshes | None = None,
    tokens: Tokens | None = None,
) -> WorkerState:
    """Seed, build the model with `plan` applied (needs the process group the plan is for), its optimizer,
    restore a checkpoint if `restore` finds one, and the data sampler. `meshes` reuses process groups
    across several plans built in one process; `tokens` the data already loaded there."""
    torch.manual_seed(recipe.train.seed)
    model = build_sharded(recipe.model, plan, device, meshes)
    optimizer = build_optimizer(model, recipe.train)
    first = restore(model, optimizer) if restore is not None else 0
    data = tokens if tokens is not None else load_tokens(recipe.data, recipe.train.seed)
    sampler = BatchSampler(data, plan.seq_len, recipe.train.seed)
    return WorkerState(plan, model, optimizer, sampler, device, first)
