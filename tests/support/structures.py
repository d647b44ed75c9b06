"""Small language models laid out the ways users lay theirs out, for the any-model tests.

Each factory returns an `nn.Module` whose forward(tokens [batch, seq]) returns logits over at least
the 256 byte tokens. Widths are chosen not to divide 2 or 4 workers, nor the split factors.
"""

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 257


class Attention(nn.Module):
    """Causal self-attention with one fused qkv Linear (nanoGPT's layout)."""

    def __init__(self, dim: int, heads: int = 3) -> None:
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
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm block whose norms are siblings of attention and MLP (nanoGPT, Hugging Face)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ModuleDictGPT(nn.Module):
    """nanoGPT's layout: a ModuleDict holding the embeddings, a ModuleList of blocks and the final
    norm; the head outside it, tied to the token embedding."""

    def __init__(self, dim: int = 30, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, dim),
                "wpe": nn.Embedding(max_len, dim),
                "drop": nn.Dropout(0.0),
                "h": nn.ModuleList(Block(dim) for _ in range(layers)),
                "ln_f": nn.LayerNorm(dim),
            }
        )
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.drop(t.wte(tokens) + t.wpe(torch.arange(tokens.shape[1], device=tokens.device)))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


class Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class NestedSequential(nn.Module):
    """Stages in a Sequential iterated as a list; each stage a called Sequential of blocks."""

    def __init__(self, dim: int = 26) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.stages = nn.Sequential(nn.Sequential(Residual(dim), Residual(dim)), nn.Sequential(Residual(dim)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for stage in self.stages:
            x = stage(x)
        return self.head(self.norm(x))


class Widen(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in)
        self.proj = nn.Linear(d_in, d_out)
        self.mix = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(self.norm(x)))
        return h + self.mix(h)


class UnequalWidths(nn.Module):
    """Blocks of growing widths; the output projection reuses the embedding table through its weight
    (`x @ embed.weight.T` in the root's forward), so the embedding must stay with the root."""

    def __init__(self, widths: tuple[int, ...] = (22, 34, 22)) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, widths[0])
        self.blocks = nn.ModuleList(Widen(a, b) for a, b in pairwise(widths))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x @ self.embed.weight.T


class RootParamsAndBuffer(nn.Module):
    """A root-level parameter, a registered buffer, a module that never runs, and an untied Linear head
    whose unit holds nothing but that Linear."""

    def __init__(self, dim: int = 30, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.register_buffer("positions", torch.randn(max_len, dim) * 0.02)
        self.gain = nn.Parameter(torch.ones(1, 1, dim))
        self.blocks = nn.ModuleList(Residual(dim) for _ in range(2))
        self.unused = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x * self.gain)


class TiedAcross(nn.Module):
    """Ties inside a container (the first Linear of both blocks is one weight) and across containers
    (a ModuleDict's embedding and the head outside it)."""

    def __init__(self, dim: int = 26) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"embed": nn.Embedding(VOCAB, dim), "norm": nn.LayerNorm(dim)})
        self.blocks = nn.ModuleList(Residual(dim) for _ in range(2))
        self.blocks[1].up.weight = self.blocks[0].up.weight
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.parts["embed"].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.parts["embed"](tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.parts["norm"](x))


class TwiceMLP(nn.Module):
    """A block whose forward calls one child twice."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(torch.tanh(self.ff(self.norm(x))))


class ReusedBlock(nn.Module):
    """The first block runs again after the last, under a second name (one module registered twice),
    and a block calls its Linear twice."""

    def __init__(self, dim: int = 30) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim), TwiceMLP(dim)])
        self.again = self.blocks[0]
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.again(x))


class GatedMLP(nn.Module):
    """Hugging Face Llama's MLP: every parameter sits in a Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Hugging Face's decoder layer: four parameter-holding children, norms registered last."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.self_attn = Attention(dim)
        self.mlp = GatedMLP(dim, 2 * dim + 6)
        self.input_layernorm = nn.RMSNorm(dim)
        self.post_attention_layernorm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLMOutput:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class HFLike(nn.Module):
    """`*ForCausalLM`: a body module holding the layers, an untied Linear head, an output object."""

    def __init__(self, dim: int = 30, layers: int = 2) -> None:
        super().__init__()
        self.model = Body(dim, layers)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(self.lm_head(self.model(tokens)))


class LinearBlock(nn.Module):
    """A block whose units hold nothing but Linears (its norm has no parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Linear(dim, dim)
        self.mlp = GatedMLP(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(F.rms_norm(x, (x.shape[-1],)))
        return x + self.mlp(F.rms_norm(x, (x.shape[-1],)))


class PlainLinears(nn.Module):
    def __init__(self, dim: int = 30) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(LinearBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Boxed:
    """A plain object around a tensor: pytree cannot open it."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class BoxedMLP(MLP):
    def forward(self, x: torch.Tensor) -> Boxed:  # type: ignore[override]
        return Boxed(super().forward(x))


class BoxBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = BoxedMLP(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.mlp(x).value)


class OpaqueOutput(nn.Module):
    """A block's child returns its tensor inside a plain object, where FSDP2 cannot hook its backward."""

    def __init__(self, dim: int = 22) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(BoxBlock(dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TorchEncoder(nn.Module):
    """torch's own nn.TransformerEncoder, whose constructor deep-copies one layer into each of its layers."""

    def __init__(self, dim: int = 36, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 3, 2 * dim + 2, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


STRUCTURES = {
    "moduledict_gpt": ModuleDictGPT,
    "nested_sequential": NestedSequential,
    "unequal_widths": UnequalWidths,
    "root_params_buffer": RootParamsAndBuffer,
    "tied_across": TiedAcross,
    "reused_block": ReusedBlock,
    "hf_like": HFLike,
    "plain_linears": PlainLinears,
    "opaque_output": OpaqueOutput,
    "torch_encoder": TorchEncoder,
}


class ValueGate(nn.Module):
    """Branches on a tensor's value, which no fake tensor has."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if x.sum() > 0 else x


class ValueBranch(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Residual(dim), ValueGate(dim)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SmallVocab(nn.Module):
    """Logits over 100 tokens, while the data's bytes go up to 255."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 100)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))
