"""`train.compile`: each unit's forward runs through torch.compile, composed with activation
checkpointing at a world of one and with FSDP2 on a fake rank, and trains as the eager model does."""

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from helpers import ZooModel, plan_zoo, zoo_request
from osdp_planners.plan import Plan
from osdp_planners.torch_private import register_fake_backend
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.apply import apply_plan
from osdp_platform.runtime.step import train_step

BUILD = ZooModel("llama", 2)
SEQ = 32


def _plan(planner: str, workers: int) -> Plan:
    req = dataclasses.replace(zoo_request("llama", workers, seq_len=SEQ, micro_batch=2), planner=planner, compile=True)
    return plan_zoo(BUILD, req).plan


def _compiled(model: nn.Module, plan: Plan) -> list[str]:
    """The unit modules whose forward is a torch.compile wrapper."""
    paths = [m for u in plan.units if u.modules != [""] for m in u.modules]
    return [p for p in paths if hasattr(model.get_submodule(p).forward, "_torchdynamo_orig_callable")]


def _steps(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """Losses of SGD steps (AdamW's update would turn rounding-level gradient differences into lr-sized ones)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return [float(train_step(model, optimizer, [(x, x)], 1)) for x in batches]


def test_the_recipe_key_reaches_the_plan() -> None:
    recipe = load_recipe("recipes/tiny.yaml", ["train.compile=true"])
    assert recipe.train.compile is True
    assert _plan("ddp", 1).compile is True


def test_compiled_units_train_as_the_eager_model_with_checkpointing() -> None:
    plan = _plan("ddp", 1)
    units = [u.model_copy(update={"checkpoint": u.name == "layers.0.mlp"}) for u in plan.units]
    plan = plan.model_copy(update={"units": units})
    torch.manual_seed(0)
    reference = BUILD("cpu")
    torch.manual_seed(0)
    model = BUILD("cpu")
    apply_plan(model, plan, "cpu")
    assert sorted(_compiled(model, plan)) == sorted(m for u in plan.units if u.modules != [""] for m in u.modules)
    batches = [torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected, got = _steps(reference, batches), _steps(model, batches)
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=1e-5), (got, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


def test_compiled_units_compose_with_fsdp2_on_a_fake_rank() -> None:
    plan = _plan("zero3", 2)
    register_fake_backend()
    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        model = BUILD("cpu")
        apply_plan(model, plan, "cpu")
        assert len(_compiled(model, plan)) == sum(len(u.modules) for u in plan.units if u.modules != [""])
        before = [p.to_local().clone() for p in model.parameters()]
        _steps(model, [torch.randint(0, 256, (2, SEQ)) for _ in range(2)])
        # backward reached every shard through the compiled forwards; the values are not checked: on a
        # fake rank collectives leave their outputs as allocated, so they may be anything (NaN on torch 2.11)
        assert all(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(), strict=True))
    finally:
        dist.destroy_process_group()
