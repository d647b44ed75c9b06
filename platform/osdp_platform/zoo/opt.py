"""OPT family: LayerNorm, learned positions, ReLU MLP, biased Linears, head tied to embeddings.

Every size uses the plain pre-norm layout; OPT-350m's project_in/out and post-norm variant are
left out so all sizes share one structure.
"""

from __future__ import annotations

from functools import partial

from torch import nn

from .layers import TiedDecoder, ZooConfig

VOCAB = 50272
SEQ = 2048

_preset = partial(ZooConfig, "opt")


def _shape(size: str, dim: int, n_layers: int, n_heads: int) -> ZooConfig:
    return _preset(size, VOCAB, dim, n_layers, n_heads, 4 * dim, SEQ)


PRESETS: dict[str, ZooConfig] = {
    "tiny": _preset("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=128),
    "125m": _shape("125m", 768, 12, 12),
    "350m": _shape("350m", 1024, 24, 16),
    "1.3b": _shape("1.3b", 2048, 24, 32),
    "2.7b": _shape("2.7b", 2560, 32, 32),
    "6.7b": _shape("6.7b", 4096, 32, 32),
    "13b": _shape("13b", 5120, 40, 40),
    "30b": _shape("30b", 7168, 48, 56),
}


class OPT(TiedDecoder):
    """OPT-style decoder (ReLU); the output projection shares its weight with ``embed.tok``."""

    @staticmethod
    def activation() -> nn.Module:
        return nn.ReLU()
