"""Operator splitting: one Linear computed as k slice Linears, each its own sharding unit.

Slices cut the *output* features. Each output element is then still one dot product over all input
features, exactly as in the unsplit Linear, so results match it to fp32 rounding with no extra sum;
the bias splits with its rows; and the backward needs no cross-slice reduction for the weights.
Splitting the input features instead would add a k-way sum of partial outputs in forward (a full
output-sized temporary per slice) and change the summation order.
"""

import torch
from torch import nn


def slice_sizes(features: int, k: int) -> list[int]:
    """Near-equal slice widths, the larger ones first (e.g. 10 into 4 -> 3, 3, 2, 2)."""
    base, extra = divmod(features, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


class SplitLinear(nn.Module):
    """y = cat([x @ W_i.T + b_i for each slice i], -1), with W = cat(W_i) the original weight."""

    def __init__(self, in_features: int, out_features: int, k: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= k <= out_features:
            raise ValueError(f"split factor {k} must be between 1 and out_features={out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.slices = nn.ModuleList(
            nn.Linear(in_features, width, bias=bias, device=device, dtype=dtype)
            for width in slice_sizes(out_features, k)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int) -> "SplitLinear":
        """A split copy of `linear` (same device and dtype; values copied unless on meta)."""
        w = linear.weight
        split = cls(linear.in_features, linear.out_features, k, linear.bias is not None, w.device, w.dtype)
        if w.device.type != "meta":
            with torch.no_grad():
                rows = slice_sizes(linear.out_features, k)
                for piece, ws in zip(split.slices, torch.split(w, rows), strict=True):
                    piece.weight.copy_(ws)
                if linear.bias is not None:
                    for piece, bs in zip(split.slices, torch.split(linear.bias, rows), strict=True):
                        piece.bias.copy_(bs)
        return split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([piece(x) for piece in self.slices], dim=-1)


def split_linear_in(model: nn.Module, path: str, k: int) -> SplitLinear:
    """Replace the Linear at `path` inside `model` by its k-way split; returns the new module."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    linear = getattr(parent, name)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{path} is a {type(linear).__name__}, not nn.Linear")
    split = SplitLinear.from_linear(linear, k)
    setattr(parent, name, split)
    return split
