"""Model FLOPs utilisation: the share of the device's peak a training run turns into model arithmetic.

MFU = (6 N + 12 L d s) x tokens/s / peak FLOP/s, with N the weights a token is multiplied by: the
model's Linear layers (transformers' GPT-2 has its own, `Conv1D`) and, in a mixture-of-experts layer,
its router and the experts a token is routed to; L its layers, d its width and s the sequence length (the PaLM paper's
count: 6 FLOPs per weight per token for forward and backward, and the attention scores and values).
Recomputation is not model arithmetic, so checkpointing lowers MFU; the peak is the preset's (hardware.py).
"""

import sys
from dataclasses import dataclass

from torch import nn

# (layers, width) attribute names of the model configurations the platform builds: zoo, HF Llama/OPT, GPT-2
_SHAPE_NAMES = (("n_layers", "dim"), ("num_hidden_layers", "hidden_size"), ("n_layer", "n_embd"))


@dataclass(frozen=True)
class ModelShape:
    linear_params: int  # N
    n_layers: int  # L (0 where the model's configuration does not say: the attention term is left out)
    dim: int  # d

    def flops_per_token(self, seq_len: int) -> float:
        return 6 * self.linear_params + 12 * self.n_layers * self.dim * seq_len


def _linear_kinds() -> tuple[type[nn.Module], ...]:
    """nn.Linear, and transformers' Conv1D where a model has loaded it (GPT-2's Linear, its weight transposed)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def _moe_weights(model: nn.Module, top_k: object) -> int:
    """The mixture-of-experts weights one token meets: all of each router's (E x d, a Linear that is not
    an nn.Linear: it scores every expert) and `top_k` (the config's num_experts_per_tok) of each bank of
    `num_experts` (transformers' `*Experts` modules hold one 3D parameter per projection, a matrix per expert)."""
    if not isinstance(top_k, int):
        return 0
    weights = 0
    for module in model.modules():
        experts, own = getattr(module, "num_experts", None), list(module.parameters(recurse=False))
        if not isinstance(experts, int) or not own:
            continue
        if all(p.dim() == 3 and p.shape[0] == experts for p in own):
            weights += sum(p.numel() for p in own) * top_k // experts
        elif len(own) == 1 and own[0].dim() == 2 and own[0].shape[0] == experts:
            weights += own[0].numel()
    return weights


def model_shape(model: nn.Module) -> ModelShape:
    """N from the model's Linear layers and routed experts (on any device, meta included), L and d from its
    `config`."""
    kinds = _linear_kinds()
    config = getattr(model, "config", None)
    linear = sum(m.get_parameter("weight").numel() for m in model.modules() if isinstance(m, kinds))
    linear += _moe_weights(model, getattr(config, "num_experts_per_tok", None))
    for layers, width in _SHAPE_NAMES:
        if isinstance(getattr(config, layers, None), int) and isinstance(getattr(config, width, None), int):
            return ModelShape(linear, getattr(config, layers), getattr(config, width))
    return ModelShape(linear, 0, 0)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """The fraction of `peak_flops_per_s` that `tokens_per_s` of `flops_per_token` each amounts to."""
    return tokens_per_s * flops_per_token / peak_flops_per_s
