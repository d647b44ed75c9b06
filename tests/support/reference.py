"""The single-process reference every sharded plan is checked against: one unsharded model and a plain
torch optimizer fed each step's whole global batch. Written with plain torch on purpose, so that it
shares nothing with the shipped step (osdp_platform.runtime.step) it checks."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.data import BatchSampler, load_tokens


def reference_run(
    build: Callable[[], nn.Module], recipe: Recipe, global_batch: int, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and the final parameters; `build` runs after the recipe's seed is set."""
    t = recipe.train
    torch.manual_seed(t.seed)
    model = build()
    optimizer: torch.optim.Optimizer
    if t.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    sampler = BatchSampler(load_tokens(recipe.data, t.seed), recipe.data.seq_len, t.seed)
    losses = []
    for step in range(steps):
        x, y = sampler.global_batch(step, global_batch)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out  # Hugging Face models return an output object
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
