"""A user's own model, as `model.target: "nanogpt:GPT"` in recipes/nanogpt.yaml loads it.

The layout of Karpathy's nanoGPT (a ModuleDict holding the embeddings, a ModuleList of blocks and
the final norm; the head outside it, tied to the token embedding), written here from scratch. The
platform needs nothing from it beyond `forward(tokens) -> logits`: no base class, no registration.
Put the folder holding such a file on PYTHONPATH (`PYTHONPATH=recipes osdp-platform ...`).
"""

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(x).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(tokens [batch, seq]) -> logits [batch, seq, vocab]; vocab must cover the data's 256 bytes."""

    def __init__(
        self, vocab_size: int = 256, block_size: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "h": nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        """Small weights: the tied table also scores the output, and N(0, 1) logits start far off."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = t.wte(tokens) + t.wpe(positions)
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))
