"""The profiler on real CPU tensors (small models) records exactly what it records on fake tensors, and falls
back to fake tensors where a model's ops differ by device."""

import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from osdp_planners import make_plan_for, run_tensors
from osdp_planners.options import Variant
from osdp_planners.profiler import profile_model
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.schema import ModelSection, Recipe
from osdp_platform.runtime.models import build_model
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


HF_LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_a_transformers_model_is_profiled_in_the_compute_dtype() -> None:
    """Under bf16-mixed the workers compute, and keep activations, in bf16; a transformers model was built in
    fp32 whatever the profiler asked, so its predicted peak was fp32's (32.2 MiB against 20.8 measured on
    2 CPU workers, as under fp32). Its master weights stay fp32 where nothing else is asked."""
    peaks = {}
    for precision in ("fp32", "bf16-mixed"):
        recipe = Recipe.model_validate(
            {
                "model": {"hf_config": HF_LLAMA},
                "data": {"source": "corpus", "seq_len": 128},
                "hardware": {"workers_per_node": 2},
                "planner": {"name": "zero3"},
                "train": {"micro_batch_size": 8, "precision": precision},
            }
        )
        built = partial(build_model, recipe.model)
        assert {p.dtype for p in built("meta").parameters()} == {torch.float32}
        request = dataclasses.replace(plan_request(recipe), model_key=None)  # profiled now, not read from a cache
        peaks[precision] = make_plan_for(built, request, None).plan.predicted.peak_memory_bytes
    assert peaks["bf16-mixed"] < 0.75 * peaks["fp32"], peaks


def test_attention_counts_the_flops_of_its_scaled_dot_product() -> None:
    """The profile traces on CPU, where scaled_dot_product_attention runs a kernel torch's FLOP counter has
    no formula for: the zoo llama's attention counted its four Linears alone, and the preset priced its
    scores and values at nothing. Per sequence of SEQ tokens: the q, k, v, o projections (64 -> 64, 32, 32,
    64) and the scores and values, 2 x 2 x SEQ x SEQ x 64 over its heads."""
    profile = profile_model(partial(build_model, ModelSection(family="llama", size="tiny")), SEQ, VOCAB, variants=())
    projections = 2 * SEQ * 64 * (64 + 32 + 32 + 64)
    assert profile.forward_flops("layers.0.attn", 1) == projections + 4 * SEQ * SEQ * 64
