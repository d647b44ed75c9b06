"""Model zoo: shapes, parameter counts, causality, tying, determinism and the module-layout contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from osdp_platform.zoo import FAMILIES, build_zoo_model, zoo_sizes
from osdp_platform.zoo.layers import ZooConfig, apply_rope, rope_tables

ALL_PRESETS = [(family, size) for family, sizes in zoo_sizes().items() for size in sizes]
TINY = list(FAMILIES)
TIED = {"llama": False, "gpt2": True, "opt": True}


def expected_params(c: ZooConfig) -> int:
    """Closed-form parameter count, written from each architecture rather than from the code."""
    d, f, v, layers = c.dim, c.ffn_dim, c.vocab_size, c.n_layers
    if c.family == "llama":
        head_dim = d // c.n_heads
        kv = (c.n_kv_heads or c.n_heads) * head_dim
        attn = d * d + 2 * d * kv + d * d  # q, k, v, o without bias
        mlp = 3 * d * f  # gate, up, down without bias
        return 2 * v * d + layers * (attn + mlp + 2 * d) + d  # untied head; two RMSNorms per layer + final
    attn = 4 * (d * d + d)  # q, k, v, o with bias
    mlp = d * f + f + f * d + d  # fc1, fc2 with bias
    norms = 2 * 2 * d  # two LayerNorms (weight + bias)
    return v * d + c.max_seq_len * d + layers * (attn + mlp + norms) + 2 * d  # tied head; final LayerNorm


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def build_meta(family: str, size: str, **overrides: int) -> nn.Module:
    with torch.device("meta"):
        return build_zoo_model(family, size, **overrides)


def build_cpu(family: str, seed: int = 0, **overrides: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return build_zoo_model(family, "tiny", **overrides)


@pytest.mark.parametrize(("family", "size"), ALL_PRESETS)
def test_every_preset_builds_on_meta_with_expected_param_count(family: str, size: str) -> None:
    model = build_meta(family, size)
    assert model.config.family == family and model.config.size == size
    assert model.config == FAMILIES[family][size]
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == expected_params(model.config)


@pytest.mark.parametrize(
    ("family", "size", "reference", "rel"),
    [
        ("llama", "7b", 6.74e9, 0.005),
        ("llama", "13b", 13.0e9, 0.01),
        ("llama", "70b", 69.0e9, 0.01),
        ("gpt2", "124m", 124.4e6, 0.001),
        ("gpt2", "1.5b", 1.56e9, 0.01),
        ("opt", "125m", 125.2e6, 0.01),
        ("opt", "30b", 30.0e9, 0.02),
    ],
)
def test_param_counts_match_published_sizes(family: str, size: str, reference: float, rel: float) -> None:
    assert n_params(build_meta(family, size)) == pytest.approx(reference, rel=rel)


@pytest.mark.parametrize(("family", "size"), [("llama", "1b"), ("gpt2", "osdp-48l"), ("opt", "350m")])
def test_meta_forward_shapes_on_large_presets(family: str, size: str) -> None:
    model = build_meta(family, size)
    with torch.device("meta"):
        logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, model.config.vocab_size)


def test_presets_match_requested_shapes() -> None:
    llama7 = FAMILIES["llama"]["7b"]
    assert (llama7.dim, llama7.n_layers, llama7.n_heads, llama7.ffn_dim) == (4096, 32, 32, 11008)
    assert (llama7.vocab_size, llama7.max_seq_len) == (32000, 4096)
    llama70 = FAMILIES["llama"]["70b"]
    assert (llama70.n_heads, llama70.kv_heads, llama70.ffn_dim) == (64, 8, 28672)
    assert FAMILIES["llama"]["1b"].vocab_size == 128256
    osdp = FAMILIES["gpt2"]["osdp-48l"]
    assert (osdp.dim, osdp.n_layers, osdp.n_heads, osdp.vocab_size, osdp.max_seq_len) == (
        1536,
        48,
        16,
        50257,
        1024,
    )
    for family in ("gpt2", "opt"):
        for size, cfg in FAMILIES[family].items():
            if size != "tiny":
                assert cfg.ffn_dim == 4 * cfg.dim
    assert {c.vocab_size for s, c in FAMILIES["opt"].items() if s != "tiny"} == {50272}


@pytest.mark.parametrize("family", TINY)
def test_tiny_forward_shape_and_dtype(family: str) -> None:
    model = build_cpu(family)
    tokens = torch.randint(0, model.config.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, model.config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", TINY)
def test_tiny_is_causal(family: str) -> None:
    model = build_cpu(family).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    changed = tokens.clone()
    t = 13
    changed[:, t] = (changed[:, t] + 1) % model.config.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("family", TINY)
def test_head_tying(family: str) -> None:
    model = build_cpu(family)
    assert (model.head.out.weight is model.embed.tok.weight) is TIED[family]
    assert model.head.out.bias is None
    if TIED[family]:
        names = {name for name, _ in model.named_parameters()}
        assert "head.out.weight" not in names  # shared Parameter is reported once, under embed
    meta = build_meta(family, "tiny")
    assert (meta.head.out.weight is meta.embed.tok.weight) is TIED[family]


@pytest.mark.parametrize("family", TINY)
def test_same_seed_same_weights(family: str) -> None:
    first, second = build_cpu(family, seed=7).state_dict(), build_cpu(family, seed=7).state_dict()
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    other = build_cpu(family, seed=8).state_dict()
    assert not torch.equal(first["embed.tok.weight"], other["embed.tok.weight"])


@pytest.mark.parametrize("family", TINY)
def test_init_weights_values(family: str) -> None:
    model = build_meta(family, "tiny")
    model.init_weights()  # no-op on meta, must not raise
    model = build_cpu(family)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name
        elif ".norm." in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.std().item() == pytest.approx(0.02, rel=0.25), name


@pytest.mark.parametrize("family", TINY)
def test_meta_then_materialise_then_init(family: str) -> None:
    """The sharded-training flow: build on meta, allocate with to_empty, then init_weights in place."""
    states = []
    for _ in range(2):
        model = build_meta(family, "tiny").to_empty(device="cpu")
        torch.manual_seed(3)
        model.init_weights()  # also re-ties the head, which to_empty unties
        assert (model.head.out.weight is model.embed.tok.weight) is TIED[family]
        states.append(model.state_dict())
        tokens = torch.randint(0, model.config.vocab_size, (1, 9))
        assert torch.isfinite(model(tokens)).all()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


@pytest.mark.parametrize("family", TINY)
def test_structure_contract(family: str) -> None:
    model = build_cpu(family)
    cfg = model.config
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 1  # type: ignore[misc]
    assert isinstance(model.embed.tok, nn.Embedding)
    assert model.embed(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, cfg.dim)
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == cfg.n_layers
    assert {name for name, _ in model.named_children()} == {"embed", "layers", "head"}
    assert list(model.parameters(recurse=False)) == []
    for block in model.layers:
        assert list(block.parameters(recurse=False)) == []
        with_params = {name for name, child in block.named_children() if next(child.parameters(), None) is not None}
        assert with_params == {"attn", "mlp"}
        assert hasattr(block.attn, "norm") and hasattr(block.mlp, "norm")
        x = torch.randn(1, 4, cfg.dim)
        with torch.no_grad():
            torch.testing.assert_close(block(x), (x + block.attn(x)) + block.mlp(x + block.attn(x)))
    assert isinstance(model.head.out, nn.Linear) and hasattr(model.head, "norm")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is nn.Linear for m in linears)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_llama_uses_grouped_query_attention_and_swiglu() -> None:
    model = build_meta("llama", "70b")
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert (attn.q.out_features, attn.k.out_features, attn.v.out_features) == (8192, 1024, 1024)
    assert all(getattr(attn, n).bias is None for n in "qkvo")
    assert {n for n, _ in mlp.named_children()} >= {"gate", "up", "down"}
    assert isinstance(attn.norm, nn.RMSNorm)


def test_rope_depends_only_on_relative_position() -> None:
    torch.manual_seed(0)
    head_dim = 16
    cos, sin = rope_tables(32, head_dim, 10000.0, torch.device("cpu"))
    q, k = torch.randn(head_dim), torch.randn(head_dim)
    rq = apply_rope(q.expand(1, 1, 32, head_dim), cos, sin)[0, 0]
    rk = apply_rope(k.expand(1, 1, 32, head_dim), cos, sin)[0, 0]
    torch.testing.assert_close(rq[5] @ rk[2], rq[20] @ rk[17])
    torch.testing.assert_close(rq[0], q)  # position 0 is left unrotated


def test_overrides_replace_vocab_and_seq_len() -> None:
    model = build_meta("llama", "7b", vocab_size=256, max_seq_len=512)
    assert (model.config.vocab_size, model.config.max_seq_len, model.config.dim) == (256, 512, 4096)
    assert model.head.out.out_features == 256
    assert FAMILIES["llama"]["7b"].vocab_size == 32000  # the preset itself is untouched
    gpt = build_cpu("gpt2", vocab_size=100, max_seq_len=8)
    assert gpt.embed.pos.num_embeddings == 8
    assert gpt(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 100)
    with pytest.raises(ValueError, match="max_seq_len"):
        gpt(torch.zeros(1, 9, dtype=torch.long))


def test_unknown_family_or_size_raises() -> None:
    with pytest.raises(ValueError, match=r"'bert'.*gpt2.*llama.*opt"):
        build_zoo_model("bert", "tiny")
    with pytest.raises(ValueError, match=r"'3b'.*'tiny'.*'7b'"):
        build_zoo_model("llama", "3b")
    with pytest.raises(ValueError, match="vocab_size"):
        build_zoo_model("gpt2", "tiny", vocab_size=0)


def test_zoo_sizes_lists_every_preset() -> None:
    sizes = zoo_sizes()
    assert sizes["llama"] == ["tiny", "1b", "7b", "13b", "70b"]
    assert sizes["gpt2"] == ["tiny", "124m", "355m", "774m", "1.5b", "osdp-48l"]
    assert sizes["opt"] == ["tiny", "125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b"]
