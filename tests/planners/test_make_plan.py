"""A process profiles a model once: the same model under other planners or budgets reuses it, nothing else does."""

from dataclasses import replace

import torch

from helpers import zoo_request
from osdp_planners import Builder, build_context
from osdp_platform.zoo import build_zoo_model


def llama(n_layers: int) -> Builder:
    def build(device: str) -> torch.nn.Module:
        with torch.device(device):
            return build_zoo_model("llama", "tiny", n_layers=n_layers)

    return build


def test_profile_reused_only_for_the_same_model_and_shape() -> None:
    req = replace(zoo_request("llama", 2, seq_len=16), model_key="llama tiny, 1 layer")
    first = build_context(llama(1), req, None).profile
    elsewhere = replace(req, planner="ddp", workers_per_node=4, memory_limit_bytes=1 << 20)
    assert build_context(llama(1), elsewhere, None).profile is first

    fresh = build_context(llama(1), replace(req, model_key=None), None).profile
    assert fresh is not first and fresh == first  # what reuse hands out is what profiling returns

    longer = build_context(llama(1), replace(req, seq_len=32), None).profile
    assert longer is not first and longer.modules[0].variants != first.modules[0].variants
    # a model under the same key but with another structure (a recipe's kwargs changed) is profiled anew
    deeper = build_context(llama(2), req, None).profile
    assert len(deeper.modules) > len(first.modules)
