"""One training step, the same function for the Ray Train worker, the tests and the benchmarks.

A step runs `grad_accum_steps` micro batches forward and backward and then the optimizer. FSDP2
reduce-scatters the gradients after every micro batch (its default): accumulating them unsharded
instead would keep a full gradient copy per unit alive across micro batches, which the plan's memory
model does not allow for. Each micro batch's loss is divided by the number of micro batches, so the
accumulated gradient is the gradient of the mean loss over the whole step's samples.
"""

from collections.abc import Iterable

import torch
from torch import nn

from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.runtime import make_optimizer
from osdp_platform.recipe.schema import TrainSection

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, next-token targets


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Iterable[Batch], grad_accum_steps: int
) -> torch.Tensor:
    """Forward and backward over the micro batches, then one optimizer step.

    Returns this rank's mean loss as a detached 0-d tensor: reading it waits for the device, so the
    caller decides when (it also keeps the step usable on fake tensors, which have no value).
    """
    losses = []
    for x, y in micro_batches:
        loss = lm_loss(logits_of(model(x)), y) / grad_accum_steps
        loss.backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).sum()


def build_optimizer(model: nn.Module, train: TrainSection) -> torch.optim.Optimizer:
    """The optimizer over `model`'s live parameters: build it after sharding, or it updates the wrong tensors.
    The planner's probe times the same optimizer (osdp_planners.runtime)."""
    device_type = next(model.parameters()).device.type
    return make_optimizer(model.parameters(), train.optimizer, device_type, train.lr, train.weight_decay)
