"""Operator splitting: one Linear computed as k slice Linears, each its own sharding unit.

Slices cut the *output* features. Each output element is then still one dot product over all input
features, exactly as in the unsplit Linear, so results match it to fp32 rounding with no extra sum;
the bias splits with its rows; and the backward needs no cross-slice reduction for the weights.
Splitting the input features instead would add a k-way sum of partial outputs in forward (a full
output-sized temporary per slice) and change the summation order.

Checkpoints use the unsplit names, so one saved under split k loads under any other split or none:
`state_dict()` reports `x.weight` / `x.bias` (the slices concatenated) instead of `x.slices.i.*`, and
`load_state_dict` cuts `x.weight` / `x.bias` back into the slices (they win over slice-named entries).
What works, and the limits:

- plain modules: `state_dict` / `load_state_dict` in both directions, any k, or a plain `nn.Linear`.
- after `fully_shard` (slices hold DTensors sharded on dim 0), `torch.distributed.checkpoint.state_dict`:
  `get_model_state_dict(full_state_dict=True)` returns unsplit names and full values;
  `set_model_state_dict(full_state_dict=True)` with the full unsplit dict on every rank loads into any
  split factor and plan (each rank cuts its own shards, no communication).
- sharded (non-full) model state dicts also carry unsplit names, so DCP save/load works across split
  factors too; but concatenated dim-0 shards are not a dim-0 shard of anything, so `x.weight` is a
  replicated DTensor made by DTensor's `cat` (an all-gather): every rank holds the whole weight of each
  split Linear while such a state dict is alive.
- `set_model_state_dict(broadcast_from_rank0=True)` matches keys against the live parameter names
  before this module's hook runs: with unsplit names the other ranks fail (missing keys) while rank 0
  goes on. Rename first with `to_split_names`, or give every rank the full dict.
- optimizer state dicts keep the slice names (they are keyed by live parameters); checkpoint.py renames
  them to unsplit names on save and back on load (`optim_unsplit` / `optim_split`).
- reading `.weight` / `.bias` concatenates; on sharded slices that is a collective every rank must
  join (DCP's key lookup does it once per key while building a model state dict).
"""

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

_TENSORS = ("weight", "bias")


def slice_sizes(features: int, k: int) -> list[int]:
    """Near-equal slice widths, the larger ones first (e.g. 10 into 4 -> 3, 3, 2, 2)."""
    base, extra = divmod(features, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`value` (a full slice) laid out as `target`: a DTensor is cut locally on each rank."""
    if isinstance(target, DTensor):
        return distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    return value


class SplitLinear(nn.Module):
    """y = cat([x @ W_i.T + b_i for each slice i], -1), with W = cat(W_i) the original weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        k: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= k <= out_features:
            raise ValueError(f"split factor {k} must be between 1 and out_features={out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.slices = nn.ModuleList(
            nn.Linear(in_features, width, bias=bias, device=device, dtype=dtype)
            for width in slice_sizes(out_features, k)
        )
        # torch leaves these two registrations unannotated
        self.register_state_dict_post_hook(_save_unsplit)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_load_unsplit)  # type: ignore[no-untyped-call]

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int) -> "SplitLinear":
        """A split copy of `linear` (same device and dtype; values copied unless on meta)."""
        w = linear.weight
        split = cls(linear.in_features, linear.out_features, k, linear.bias is not None, w.device, w.dtype)
        if w.device.type != "meta":
            with torch.no_grad():
                rows = slice_sizes(linear.out_features, k)
                for piece, ws in zip(split.pieces, torch.split(w, rows), strict=True):
                    piece.weight.copy_(ws)
                if linear.bias is not None:
                    for piece, bs in zip(split.pieces, torch.split(linear.bias, rows), strict=True):
                        piece.bias.copy_(bs)
        return split

    @property
    def pieces(self) -> list[nn.Linear]:
        """`slices` typed as what they are: a ModuleList is declared to hold any Module."""
        return cast(list[nn.Linear], list(self.slices))

    @property
    def rows(self) -> list[int]:
        return [piece.out_features for piece in self.pieces]

    @property
    def weight(self) -> torch.Tensor:
        """The unsplit weight, concatenated on each access (a collective on sharded slices)."""
        return torch.cat([piece.weight for piece in self.pieces])

    @property
    def bias(self) -> torch.Tensor | None:
        if self.slices[0].bias is None:
            return None
        return torch.cat([piece.bias for piece in self.pieces])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([piece(x) for piece in self.slices], dim=-1)


def _save_unsplit(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    """Replace `prefix.slices.i.{weight,bias}` by `prefix.{weight,bias}`, in nn.Linear's key order."""
    assert isinstance(module, SplitLinear)
    n = len(module.slices)
    for name in _TENSORS:
        keys = [f"{prefix}slices.{i}.{name}" for i in range(n)]
        if keys[0] in state_dict:
            state_dict[prefix + name] = torch.cat([state_dict.pop(k) for k in keys])
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [f"{prefix}slices", *(f"{prefix}slices.{i}" for i in range(n))]:
            metadata.pop(key, None)


def _load_unsplit(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    _meta: Any,
    _strict: bool,
    _missing: list[str],
    _unexpected: list[str],
    error_msgs: list[str],
) -> None:
    """Cut `prefix.{weight,bias}` into the slices' entries (overriding any slice-named entries)."""
    assert isinstance(module, SplitLinear)
    for name in _TENSORS:
        key = prefix + name
        targets = [getattr(piece, name) for piece in module.slices]
        if key not in state_dict or targets[0] is None:
            continue  # absent, or a key this module does not have: strict loading reports it
        full = _full(state_dict.pop(key))
        if full.shape[0] != module.out_features:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {tuple(full.shape)}, "
                f"the model's has {module.out_features} rows"
            )
            continue
        for i, (piece, target) in enumerate(zip(torch.split(full, module.rows), targets, strict=True)):
            state_dict[f"{prefix}slices.{i}.{name}"] = _like(piece, target)


def to_split_names(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of an unsplit-named full state dict with every SplitLinear's entries cut into its slices."""
    out = dict(state_dict)
    for path, module in model.named_modules():
        if isinstance(module, SplitLinear):
            prefix = f"{path}." if path else ""
            for name in _TENSORS:
                key = prefix + name
                if key in out and getattr(module.slices[0], name) is not None:
                    full = _full(out.pop(key))
                    for i, piece in enumerate(torch.split(full, module.rows)):
                        out[f"{prefix}slices.{i}.{name}"] = piece
    return out


def linear_at(model: nn.Module, path: str) -> nn.Linear:
    """The nn.Linear at `path` (a TypeError names what is there instead)."""
    linear = model.get_submodule(path)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{path} is a {type(linear).__name__}, not nn.Linear")
    return linear


def split_linear_in(model: nn.Module, path: str, k: int) -> SplitLinear:
    """Replace the Linear at `path` inside `model` by its k-way split; returns the new module."""
    parent_path, _, name = path.rpartition(".")
    split = SplitLinear.from_linear(linear_at(model, path), k)
    setattr(model.get_submodule(parent_path), name, split)
    return split
