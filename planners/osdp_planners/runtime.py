"""What the workers run, in one place: the compute dtype, FSDP2's mixed-precision policy, the optimizer.

The planner times the model as the runtime trains it; both build these from here, so a change to the
training precision or the optimizer reaches the probe and the workers alike.
"""

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls and activations run in: bf16-mixed computes in bf16 over fp32 master weights."""
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float32


def mp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: bf16 gathered parameters and compute, gradients reduced and kept in fp32."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compile_units(model: nn.Module, paths: Iterable[str]) -> None:
    """`train.compile`: each unit's forward through torch.compile, one module at a time as torchtitan
    compiles per block. Only `forward` is compiled: the hooks around it (FSDP2's gathers, activation
    checkpointing, autocast) stay eager, so sharding and checkpointing compose as they do uncompiled.
    Static shapes: the probe's two timing batches must not turn the workers' graphs dynamic."""
    for path in paths:
        module = model.get_submodule(path)
        module.forward = torch.compile(module.forward, dynamic=False)


def make_optimizer(
    params: Iterable[nn.Parameter], name: str, device_type: str, lr: float = 1e-4, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """SGD, or AdamW: fused on CUDA (one kernel for all tensors instead of a loop of small ones)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=device_type == "cuda" or None)
