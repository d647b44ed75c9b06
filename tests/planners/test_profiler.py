"""The profiler on real CPU tensors (small models) records exactly what it records on fake tensors, and falls
back to fake tensors where a model's ops differ by device."""

from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from osdp_planners import run_tensors
from osdp_planners.options import Variant
from osdp_planners.profiler import profile_model
from osdp_platform.zoo import build_zoo_model
from structures import STRUCTURES

SEQ, VOCAB = 32, 256
GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 3, "n_head": 2, "n_positions": SEQ}  # dropout on, as shipped
VARIANTS = (Variant(2, True), Variant(8))  # a split and a checkpointed one beside the plain run

# name -> builder, compute dtype, whether it records on real tensors what it records on fake ones
MODELS: dict[str, tuple[Callable[[], nn.Module], torch.dtype, bool]] = {
    "zoo-llama-bf16": (lambda: build_zoo_model("llama", "tiny"), torch.bfloat16, True),
    "zoo-gpt2-tied": (lambda: build_zoo_model("gpt2", "tiny", dim=64, n_layers=3, n_heads=2), torch.float32, True),
    "reused-block": (STRUCTURES["reused_block"], torch.float32, True),
    # CPU dropout multiplies by a float noise tensor; fake tensors keep a bool mask, as CUDA does
    "hf-gpt2-dropout": (
        lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **GPT2, use_cache=False)),
        torch.float32,
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_tensors_record_the_fake_tensors_profile(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, dtype, same_ops = MODELS[name]
    with torch.device("meta"):
        assert run_tensors.small_enough(build(), SEQ), "the case must be small enough to run for real"
    used: list[bool] = []  # per model built: on real tensors or not
    tensors = run_tensors.tensors
    monkeypatch.setattr(run_tensors, "tensors", lambda real: used.append(real) or tensors(real))
    profiled = profile_model(lambda _device: build(), SEQ, VOCAB, dtype, VARIANTS)
    # the plain run on fake tensors, again on real ones to compare, then the other variants
    assert used == [False, True, *[same_ops] * len(VARIANTS)]
    monkeypatch.setattr(run_tensors, "REAL_RUN_FLOPS", 0.0)
    assert profiled == profile_model(lambda _device: build(), SEQ, VOCAB, dtype, VARIANTS)


def test_profiling_on_real_tensors_leaves_the_callers_random_state() -> None:
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    profile_model(lambda _device: STRUCTURES["reused_block"](), SEQ, VOCAB)
    assert torch.equal(torch.rand(4), expected)


def test_a_large_model_profiles_on_fake_tensors() -> None:
    with torch.device("meta"):
        llama_1b, tiny = build_zoo_model("llama", "1b"), build_zoo_model("llama", "tiny")
    assert not run_tensors.small_enough(llama_1b, 2048)
    assert run_tensors.small_enough(tiny, 64) and not run_tensors.small_enough(tiny, 8192)  # long sequences
