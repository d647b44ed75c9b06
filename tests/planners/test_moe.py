"""Mixture-of-experts models (transformers' Mixtral from a small config, nothing downloaded).

Its experts run torch's grouped matmul, whose meta kernel takes bf16 alone: the structure is traced in
bf16 where fp32 fails, a profile in fp32 is refused with one message, and the expert matmuls count in
the FLOPs that share out a measured step and in MFU.
"""

import dataclasses
from functools import partial

import pytest
import torch

from osdp_planners.errors import UserError
from osdp_planners.make_plan import make_plan_for
from osdp_planners.mfu import model_shape
from osdp_planners.profiler import profile_model
from osdp_planners.units import find_units
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.preflight import Where, preflight
from osdp_platform.recipe.schema import ModelSection, Recipe
from osdp_platform.runtime.models import build_model

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, LAYERS, VOCAB = 64, 128, 4, 2, 2, 300
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 64,
}
SECTION = ModelSection.model_validate({"hf_config": MIXTRAL})


def _recipe(precision: str) -> Recipe:
    return Recipe.model_validate(
        {
            "model": {"hf_config": MIXTRAL},
            "data": {"source": "corpus", "seq_len": 32},
            "hardware": {"workers_per_node": 2},
            "planner": {"name": "zero3"},
            "train": {"micro_batch_size": 2, "precision": precision},
        }
    )


def test_a_model_that_traces_only_in_bf16_has_the_same_units_in_fp32() -> None:
    fp32 = build_model(SECTION, "meta")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        bf16 = build_model(SECTION, "meta")
    finally:
        torch.set_default_dtype(default)
    units = find_units(fp32, 16)
    assert [dataclasses.astuple(u) for u in units] == [dataclasses.astuple(u) for u in find_units(bf16, 16)]
    assert "model.layers.1.mlp" in {m for u in units for m in u.modules}


def test_an_fp32_profile_of_a_model_that_traces_only_in_bf16_is_refused_naming_the_precision() -> None:
    request = dataclasses.replace(plan_request(_recipe("fp32")), model_key=None)
    with pytest.raises(UserError) as caught:
        make_plan_for(partial(build_model, SECTION), request, None)
    assert caught.value.field == "train.precision" and caught.value.value == "fp32"
    assert "MixtralExperts" in caught.value.problem and "bf16-mixed" in caught.value.fix


def test_preflight_refuses_an_fp32_recipe_of_a_model_that_traces_only_in_bf16() -> None:
    """Found in the driver, before Ray starts, with the planner's message; bf16-mixed passes."""
    with pytest.raises(UserError) as caught:
        preflight(_recipe("fp32"), Where.NOWHERE)
    assert caught.value.field == "train.precision" and "MixtralExperts" in caught.value.problem
    preflight(_recipe("bf16-mixed"), Where.NOWHERE)


def test_the_expert_matmuls_count_in_a_units_forward_flops() -> None:
    """Per token the router multiplies by EXPERTS x HIDDEN and each of TOP_K experts by its gate, up and down
    projections; torch's FLOP counter has no formula for the grouped matmul the experts run."""
    profile = profile_model(partial(build_model, SECTION), 32, VOCAB, torch.bfloat16, variants=())
    (moe,) = [u.name for u in profile.units if u.modules[0] == "model.layers.0.mlp"]
    per_token = 2 * EXPERTS * HIDDEN + TOP_K * 2 * 3 * HIDDEN * INTERMEDIATE
    assert profile.forward_flops(moe, 1) == 32 * per_token


def test_mfu_counts_the_router_and_the_experts_a_token_is_routed_to() -> None:
    """N: per layer the attention's q, k, v, o Linears (4 heads of 16, 2 of them for k and v), the router
    (EXPERTS x HIDDEN) and TOP_K of EXPERTS experts' three HIDDEN x INTERMEDIATE matrices; the untied head."""
    attention = HIDDEN * 64 + 2 * HIDDEN * 32 + 64 * HIDDEN
    router = EXPERTS * HIDDEN
    routed = TOP_K * 3 * HIDDEN * INTERMEDIATE
    shape = model_shape(build_model(SECTION, "meta"))
    assert shape.linear_params == LAYERS * (attention + router + routed) + VOCAB * HIDDEN
