"""A host profiles a model once: other planners, budgets or processes reuse it; nothing else does."""

import importlib.util
import sys
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import zoo_request
from osdp_planners import Builder, build_context, make_plan
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


MODEL_SOURCE = """
import torch


class Net(torch.nn.Module):  # {note}
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)
"""


def _net_from(folder: Path, note: str, monkeypatch: pytest.MonkeyPatch) -> Builder:
    """A model class defined in its own module file, written anew (a user's edit to the forward)."""
    path = folder / "edited_net.py"
    path.write_text(MODEL_SOURCE.replace("{note}", note))
    spec = importlib.util.spec_from_file_location("edited_net", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "edited_net", module)
    spec.loader.exec_module(module)

    def build(device: str) -> torch.nn.Module:
        with torch.device(device):
            return module.Net()

    return build


def test_a_fresh_process_reads_the_profile_from_disk_until_the_model_code_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path / "cache"))
    req = replace(zoo_request("llama", 2, seq_len=16), model_key="edited net", token_range=64)
    first = build_context(_net_from(tmp_path, "v1", monkeypatch), req, None).profile
    assert len(list((tmp_path / "cache").glob("profile-*"))) == 1

    def no_profiling(*_: object) -> None:
        raise AssertionError("profiled again")

    monkeypatch.setattr(make_plan, "_profiles", OrderedDict())  # what a new planner process starts with
    monkeypatch.setattr(make_plan, "profile_model", no_profiling)
    again = build_context(_net_from(tmp_path, "v1", monkeypatch), req, None).profile
    assert again is not first and again == first

    monkeypatch.setattr(make_plan, "_profiles", OrderedDict())
    with pytest.raises(AssertionError, match="profiled again"):
        build_context(_net_from(tmp_path, "v2: the forward was edited", monkeypatch), req, None)
