"""Build a model on fake tensors, even one that deep-copies its own layers.

Modules such as `nn.TransformerEncoder` build their layers with `copy.deepcopy`. Inside
FakeTensorMode, torch deep-copies a fake tensor through its storage and the copy lands in a fresh
fake mode, which the first operator mixing it with the model's other tensors rejects ("Mixing fake
modes NYI"). While the model is built, a deep copy is a new fake tensor of the active mode with the
same shape, strides, dtype and parameter-ness: a fake tensor has no values to copy.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class _CopiesStayFake(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if func is not torch.Tensor.__deepcopy__:
            return func(*args, **(kwargs or {}))
        tensor, memo = args
        if id(tensor) not in memo:
            copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            if isinstance(tensor, nn.Parameter):
                copy = nn.Parameter(copy, requires_grad=tensor.requires_grad)
            else:
                copy.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = copy
        return memo[id(tensor)]


def build_fake(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under the caller's FakeTensorMode, with deep copies kept in that mode."""
    with _CopiesStayFake():
        return build()
