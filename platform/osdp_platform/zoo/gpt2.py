"""GPT-2 family: LayerNorm, learned positions, GELU MLP, biased Linears, head tied to embeddings."""

from __future__ import annotations

from functools import partial

from torch import nn

from .layers import TiedDecoder, ZooConfig

VOCAB = 50257
SEQ = 1024

_preset = partial(ZooConfig, "gpt2")


def _shape(size: str, dim: int, n_layers: int, n_heads: int) -> ZooConfig:
    return _preset(size, VOCAB, dim, n_layers, n_heads, 4 * dim, SEQ)


PRESETS: dict[str, ZooConfig] = {
    "tiny": _preset("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=128),
    "124m": _shape("124m", 768, 12, 12),
    "355m": _shape("355m", 1024, 24, 16),
    "774m": _shape("774m", 1280, 36, 20),
    "1.5b": _shape("1.5b", 1600, 48, 25),
    # The 48-layer GPT shape used in the OSDP paper's experiments.
    "osdp-48l": _shape("osdp-48l", 1536, 48, 16),
}


class GPT2(TiedDecoder):
    """GPT-2-style decoder (tanh GELU); the output projection shares its weight with ``embed.tok``."""

    @staticmethod
    def activation() -> nn.Module:
        return nn.GELU(approximate="tanh")
