"""Llama family: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, untied head."""

from __future__ import annotations

from functools import partial

from torch import nn

from .layers import Attention, Block, Embed, GatedMLP, Head, ZooConfig, ZooModel

_preset = partial(ZooConfig, "llama")

PRESETS: dict[str, ZooConfig] = {
    "tiny": _preset("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=128),
    # Llama-3.2-1B shape (its context and rope base; untied head and no rope scaling, unlike the release).
    "1b": _preset(
        "1b",
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
    ),
    "7b": _preset("7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
    "13b": _preset("13b", vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, max_seq_len=4096),
    "70b": _preset(
        "70b",
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=4096,
    ),
}


class Llama(ZooModel):
    """Llama-style decoder; positions come only from rotary embeddings inside ``attn``."""

    def __init__(self, config: ZooConfig) -> None:
        def norm() -> nn.RMSNorm:
            return nn.RMSNorm(config.dim, eps=config.norm_eps)

        blocks = [
            Block(Attention(config, norm(), bias=False, rope=True), GatedMLP(config, norm()))
            for _ in range(config.n_layers)
        ]
        embed = Embed(config.vocab_size, config.dim)
        head = Head(norm(), config.dim, config.vocab_size)
        super().__init__(config, embed, blocks, head, tie_head=False)
