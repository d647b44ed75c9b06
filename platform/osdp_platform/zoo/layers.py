"""Building blocks shared by the zoo families.

Every family is assembled from the same skeleton (``embed`` -> ``layers`` -> ``head``) so that
planners and wrappers can walk any zoo model by module path without knowing its family.
Each ``attn`` / ``mlp`` carries its own pre-norm, which keeps every parameter of a block inside
exactly one of those two children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


@dataclass(frozen=True)
class ZooConfig:
    """Shape of one zoo model; frozen so a preset can never be mutated by a caller."""

    family: str
    size: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_seq_len: int
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.family}/{self.size}: {name} must be positive")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            raise ValueError(f"{self.family}/{self.size}: n_kv_heads must be positive")
        if self.dim % self.n_heads:
            raise ValueError(f"{self.family}/{self.size}: dim {self.dim} not divisible by {self.n_heads} heads")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"{self.family}/{self.size}: {self.n_heads} heads not divisible by {self.kv_heads} kv heads"
            )

    @property
    def kv_heads(self) -> int:
        """Key/value head count; equal to ``n_heads`` unless grouped-query attention is used."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Cosine/sine tables ``[T, head_dim/2]`` in float32.

    Computed from positions on every call instead of stored, so there is no buffer that could be
    left uninitialised after a meta build followed by ``to_empty``; the cost is negligible next to
    attention itself.
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = theta**-exponents
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, head_dim]``, pairing dimension i with i + head_dim/2."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    """Pre-norm causal self-attention with separate q/k/v/o Linears.

    The projections stay separate (not fused) so that a later pass can swap each Linear for a
    split version by module path.
    """

    def __init__(self, cfg: ZooConfig, norm: nn.Module, *, bias: bool, rope: bool) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta if rope else None
        self.norm = norm
        self.q = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.norm(x)
        q = self._heads(self.q(h), self.n_heads)
        k = self._heads(self.k(h), self.kv_heads)
        v = self._heads(self.v(h), self.kv_heads)
        if self.rope_theta is not None:
            cos, sin = rope_tables(seq, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        grouped = self.kv_heads != self.n_heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.o(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class GatedMLP(nn.Module):
    """Pre-norm SwiGLU MLP: ``down(silu(gate(h)) * up(h))``, no biases."""

    def __init__(self, cfg: ZooConfig, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


class DenseMLP(nn.Module):
    """Pre-norm two-layer MLP ``fc2(act(fc1(h)))`` with biases (GPT-2 / OPT style)."""

    def __init__(self, cfg: ZooConfig, norm: nn.Module, act: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.act = act
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))


class Block(nn.Module):
    """Residual block; owns no parameters itself so that ``attn`` and ``mlp`` partition it."""

    def __init__(self, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Embed(nn.Module):
    """Token embedding plus, when ``max_positions`` is given, learned absolute positions."""

    def __init__(self, vocab_size: int, dim: int, max_positions: int | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_positions, dim) if max_positions is not None else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is None:
            return h
        seq = tokens.shape[-1]
        if seq > self.pos.num_embeddings:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.pos.num_embeddings}")
        return h + self.pos(torch.arange(seq, device=tokens.device))


class Head(nn.Module):
    """Final norm and the vocabulary projection ``out`` (bias-free so it can be tied)."""

    def __init__(self, norm: nn.Module, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class ZooModel(nn.Module):
    """Decoder-only LM skeleton shared by every family: ``embed`` -> ``layers`` -> ``head``."""

    def __init__(self, config: ZooConfig, embed: Embed, blocks: list[Block], head: Head, *, tie_head: bool) -> None:
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(blocks)
        self.head = head
        self.tie_head = tie_head
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``head.out`` share ``embed.tok``'s Parameter when the family ties them.

        Needed again after ``to_empty``: moving off meta gives every module its own new Parameter,
        which silently unties the pair.
        """
        if self.tie_head:
            self.head.out.weight = self.embed.tok.weight

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        """Reset `module`'s own parameters from the global RNG: norms -> ones, biases -> zeros, the rest -> normal.

        The rules go by module kind and parameter name, one module at a time, so a model built on meta
        can be initialised shard by shard in the same RNG order (see osdp_platform.runtime.meta_init), and they
        still apply after Linears are swapped for split replacements.
        """
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, nn.LayerNorm | nn.RMSNorm) and name == "weight":
                nn.init.ones_(param)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, mean=0.0, std=INIT_STD)

    def init_weights(self) -> None:
        """Re-tie the head, then `init_module` every module in module order (on meta a no-op).

        A tied weight is drawn at each module that holds it; the head's draw, the last, is the one kept.
        """
        self.tie_weights()
        for module in self.modules():
            self.init_module(module)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``tokens [B, T]`` to next-token logits ``[B, T, vocab]``."""
        h = self.embed(tokens)
        for block in self.layers:
            h = block(h)
        return self.head(h)


class TiedDecoder(ZooModel):
    """LayerNorm, learned positions, biased Linears, a dense MLP and a head tied to the token
    embedding: the layout GPT-2 and OPT share; subclasses choose the MLP activation."""

    @staticmethod
    def activation() -> nn.Module:
        raise NotImplementedError

    def __init__(self, config: ZooConfig) -> None:
        def norm() -> nn.LayerNorm:
            return nn.LayerNorm(config.dim, eps=config.norm_eps)

        blocks = [
            Block(Attention(config, norm(), bias=True, rope=False), DenseMLP(config, norm(), self.activation()))
            for _ in range(config.n_layers)
        ]
        embed = Embed(config.vocab_size, config.dim, config.max_seq_len)
        head = Head(norm(), config.dim, config.vocab_size)
        super().__init__(config, embed, blocks, head, tie_head=True)
