"""Meta-device initialisation: sharded builds hold only their shards, with the weights of a single-process build.

Each check runs as one rank of a fake process group (real FSDP2 code, no collectives) in a fresh Python
process, one rank per process as on a real worker. The weights a rank holds are compared with the rows
of a single-process build that `torch.chunk` gives its mesh coordinate, for every parameter, bit for bit.
The memory check builds a model of Llama-2-7B width whose fp32 parameters (2.5 GiB) do not fit one
rank's share of the host, and reads the process's peak RSS.
"""

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from helpers import TEST_PATH
from osdp_planners.plan import Plan, Strategy
from osdp_planners.uniform import group_size, uniform_plan
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.schema import ModelSection, Recipe
from osdp_platform.runtime.meta_init import InitProtocol, UninitialisedParameter, init_protocol, initialize
from osdp_platform.runtime.models import build_model
from osdp_platform.zoo import build_zoo_model

GPT2 = {"family": "gpt2", "size": "tiny", "kwargs": {"n_layers": 2}}  # head tied to the embedding
ODD = {
    "family": "llama",
    "size": "tiny",  # rows that divide by neither the worlds nor the split factors
    "kwargs": {"n_layers": 1, "vocab_size": 257, "dim": 60, "n_heads": 6, "n_kv_heads": 3, "ffn_dim": 150},
}
HF_LLAMA = {
    "hf_config": {
        "model_type": "llama",
        "vocab_size": 301,
        "hidden_size": 32,
        "intermediate_size": 72,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
}
HF_GPT2 = {
    "hf_config": {
        "model_type": "gpt2",
        "vocab_size": 301,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
}
# (model, strategies cycled over the units, split factor): HF's units of Linears only are not split (see
# test_hf_models.py for the apply_plan bug that leaves out).
PLANS = [
    (GPT2, (Strategy.ZERO3,), 3),
    (GPT2, (Strategy.HSDP, Strategy.DDP, Strategy.ZERO2), 2),
    (ODD, (Strategy.ZERO3, Strategy.HSDP), 4),
    (ODD, (Strategy.DDP,), 1),
    (HF_LLAMA, (Strategy.ZERO3, Strategy.DDP), 1),
    (HF_GPT2, (Strategy.HSDP, Strategy.ZERO3), 1),
]
SEED = 11
WIDE_7B = {"family": "llama", "size": "7b", "kwargs": {"n_layers": 2}}  # 7B's width: 0.67B parameters
FAKE_RANKS = 8


def _plan(model: dict[str, Any], strategies: tuple[Strategy, ...], split: int, world: int) -> Plan:
    recipe = Recipe.model_validate({"model": model, "hardware": {"workers_per_node": world}})
    req = plan_request(recipe)
    base = uniform_plan(build_model(ModelSection.model_validate(model), "meta"), req, strategies[0], 1, 1)
    units = [
        u.model_copy(
            update={
                "strategy": strategies[i % len(strategies)],
                "split": split,
                "shard_group_size": group_size(strategies[i % len(strategies)], req),
            }
        )
        for i, u in enumerate(base.units)
    ]
    return Plan.model_validate({**base.model_dump(), "units": [u.model_dump() for u in units]})


def _expected_local(full: torch.Tensor, param: Any) -> torch.Tensor:
    """This rank's rows of a full tensor under FSDP2's dim-0 sharding (torch.chunk; trailing ranks may be empty)."""
    mesh = param.device_mesh
    chunks = torch.chunk(full, mesh.size(mesh.ndim - 1))
    coordinate = mesh.get_coordinate()[-1]
    return chunks[coordinate] if coordinate < len(chunks) else full[:0]


def check_rank(world: int, rank: int) -> list[str]:
    """In a fresh process: build every PLANS case as `rank` of `world`; names of parameters that differ."""
    import torch.distributed as dist

    from osdp_planners.torch_private import register_fake_backend

    register_fake_backend()

    from osdp_platform.runtime.models import build_sharded

    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())
    wrong = []
    for i, (model, strategies, split) in enumerate(PLANS):
        section = ModelSection.model_validate(model)
        torch.manual_seed(SEED)
        expected = build_model(section).state_dict()
        torch.manual_seed(SEED)
        sharded = build_sharded(section, _plan(model, strategies, split, world), torch.device("cpu"))
        for name, param in sharded.named_parameters():
            if ".slices." in name:  # a slice of a split Linear: its rows of the unsplit weight
                path, _, rest = name.partition(".slices.")
                index, _, leaf = rest.partition(".")
                full = torch.split(expected[f"{path}.{leaf}"], sharded.get_submodule(path).rows)[int(index)]
            else:
                full = expected[name]
            if not torch.equal(param.to_local(), _expected_local(full, param)):
                wrong.append(f"case {i} {name}")
        buffers = dict(build_model(section).named_buffers())
        wrong += [f"case {i} buffer {n}" for n, b in sharded.named_buffers() if not torch.equal(b, buffers[n])]
    dist.destroy_process_group()
    return wrong


def peak_rss_building(world: int) -> dict[str, int]:
    """In a fresh process: rank 0 of `world` builds WIDE_7B under ZeRO-3; its peak RSS and what it holds."""
    import resource

    import torch.distributed as dist

    from osdp_planners.torch_private import register_fake_backend

    register_fake_backend()

    from osdp_platform.runtime.models import build_sharded

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=world, store=dist.HashStore())
    section = ModelSection.model_validate(WIDE_7B)
    plan = _plan(WIDE_7B, (Strategy.ZERO3,), 1, world)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(SEED)
    model = build_sharded(section, plan, torch.device("cpu"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    meta = build_model(section, "meta")
    largest_unit = max(4 * u.param_count for u in plan.units)
    shards = sum(4 * p.to_local().numel() for p in model.parameters())
    dist.destroy_process_group()
    return {
        "before": before,
        "peak": peak,
        "shards": shards,
        "largest_unit": largest_unit,
        "full": 4 * sum(p.numel() for p in meta.parameters()),
    }


def _in_fresh_process(call: str) -> Any:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TEST_PATH, os.environ.get("PYTHONPATH", "")])}
    code = f"import json, test_meta_init as t; print('RESULT' + json.dumps(t.{call}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


@pytest.mark.parametrize(("world", "rank"), [(4, 3), (3, 1)])  # 2 workers: test_equivalence, test_hf_models
def test_sharded_build_holds_the_single_process_weights(world: int, rank: int) -> None:
    assert _in_fresh_process(f"check_rank({world}, {rank})") == []


def test_a_rank_never_holds_the_whole_model() -> None:
    got = _in_fresh_process(f"peak_rss_building({FAKE_RANKS})")
    grown = got["peak"] - got["before"]
    mib = 1024**2
    print(
        f"\nfull fp32 model {got['full'] / mib:.0f} MiB; rank 0 of {FAKE_RANKS}: shards {got['shards'] / mib:.0f} "
        f"MiB, largest unit {got['largest_unit'] / mib:.0f} MiB, peak RSS grew {grown / mib:.0f} MiB"
    )
    assert got["shards"] == pytest.approx(got["full"] / FAKE_RANKS, rel=0.01)
    assert grown < got["full"] / 2, "the rank held far more than its shards"
    assert grown < got["shards"] + got["largest_unit"] + 256 * mib


def test_single_process_build_is_the_zoo_init_and_transformers_init() -> None:
    """build_model's module-by-module walk draws what the zoo's init_weights and transformers' own
    initialize_weights draw (both written independently of meta_init)."""
    for family in ("llama", "gpt2"):
        torch.manual_seed(SEED)
        walked = build_model(ModelSection.model_validate({"family": family, "size": "tiny"})).state_dict()
        torch.manual_seed(SEED)
        with torch.device("cpu"):
            zoo = build_zoo_model(family, "tiny").state_dict()
        assert all(torch.equal(walked[k], zoo[k]) for k in zoo), family
    from transformers import AutoConfig, AutoModelForCausalLM

    for model in (HF_LLAMA, HF_GPT2):
        fields = dict(model["hf_config"])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.use_cache = False
        with torch.device("meta"):
            theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        theirs.to_empty(device="cpu")
        theirs.tie_weights()
        torch.manual_seed(SEED)
        theirs.initialize_weights()  # transformers' own pass over every module (nothing is flagged initialised)
        torch.manual_seed(SEED)
        ours = build_model(ModelSection.model_validate(model))
        assert type(ours) is type(theirs)
        expected = theirs.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items()), config.model_type


class _Custom(nn.Module):
    """A model whose initialiser forgets a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.empty(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(tokens.unsqueeze(-1).float().expand(*tokens.shape, 4)) + self.extra.sum()

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()


def test_a_parameter_the_initialiser_misses_is_an_error() -> None:
    model = _Custom()
    with pytest.raises(UninitialisedParameter, match="extra"):
        initialize(model, InitProtocol(model.init_module, children_first=False))


def test_each_unit_is_drawn_on_the_device_the_model_trains_on() -> None:
    """A GPU worker draws its units there (a 7B drawn on CPU took 42 s to build); meta stands in for it."""
    reference = build_model(ModelSection.model_validate(GPT2), "meta")
    protocol = init_protocol(reference)
    assert protocol is not None
    drawn: dict[str, torch.device] = {}
    initialize(reference, protocol, lambda full: drawn.update({n: t.device for n, t in full.items()}), "meta")
    assert set(drawn) == {n for n, _ in reference.named_parameters()}
    assert set(drawn.values()) == {torch.device("meta")}
