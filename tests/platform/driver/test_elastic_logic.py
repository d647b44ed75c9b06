"""The pure parts of an elastic run: the recipe keys, counting the pool, re-planning without a probe, the data split.

The run itself, on a fake multi-node cluster that loses and regains a node, is test_elastic.py.
"""

import itertools

import pytest
import torch

from helpers import RECIPES
from osdp_planners import make_plan, model_probe
from osdp_planners.errors import NoPlanFits, UserError, UserErrors
from osdp_planners.replan import replan
from osdp_platform.driver.cluster import check_nodes_host_the_plan
from osdp_platform.driver.elastic import nodes_there, should_grow, wait_for_nodes
from osdp_platform.planning.local import plan_recipe, plan_request
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.runtime.data import BatchSampler, load_tokens, rows_of
from osdp_platform.runtime.models import build_model

ELASTIC = [
    "hardware.workers_per_node=1",
    "hardware.min_nodes=1",
    "hardware.max_nodes=2",
    "train.global_batch_size=16",
    "train.checkpoint_every=2",
]


def _elastic(*overrides: str) -> Recipe:
    return load_recipe(RECIPES / "tiny.yaml", [*ELASTIC, *overrides])


def test_an_elastic_pool_is_the_range_and_plans_at_the_largest() -> None:
    hw = _elastic().hardware
    assert hw.elastic and list(hw.node_counts) == [1, 2] and hw.world_size == 2
    fixed = _elastic().at_nodes(1).hardware
    assert not fixed.elastic and fixed.world_size == 1
    assert not load_recipe(RECIPES / "tiny.yaml").hardware.elastic  # a fixed pool stays the default


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["hardware.max_nodes=null"], "hardware.max_nodes", "is needed with hardware.min_nodes"),
        (["hardware.min_nodes=3"], "hardware.min_nodes", "is above hardware.max_nodes = 2"),
        (["hardware.nodes=3"], "hardware.nodes", "outside the elastic range 1..2"),
        (["train.global_batch_size=null"], "train.global_batch_size", "must be set for an elastic pool"),
        (["train.checkpoint_every=0"], "train.checkpoint_every", "must be above 0 for an elastic pool"),
        (["planner.name=manual", f"planner.plan_file={__file__}"], "planner.name", "made for one world size"),
        # world sizes 2, 4 and 6 with micro batch 8: the global batch must be a multiple of 8 x 12
        (
            ["hardware.workers_per_node=2", "hardware.max_nodes=3", "train.global_batch_size=64"],
            "train.global_batch_size",
            "multiple of micro_batch_size x every world size of the elastic pool = 96",
        ),
    ],
)
def test_an_elastic_recipe_that_cannot_work_names_the_key(overrides: list[str], field: str, words: str) -> None:
    with pytest.raises(UserErrors) as info:
        _elastic(*overrides)
    (error,) = info.value.errors
    assert error.field == field and words in error.problem, error


def test_the_pool_is_counted_in_whole_nodes_of_workers_that_fit() -> None:
    hw = _elastic("hardware.pool=ELASTIC", "hardware.max_nodes=4", "train.global_batch_size=96").hardware
    nodes = [
        {"CPU": 2.0, "ELASTIC": 2.0},  # two workers
        {"CPU": 1.0, "ELASTIC": 1.0},  # one
        {"CPU": 8.0},  # not of the pool: none
        {"CPU": 0.0, "ELASTIC": 4.0},  # the head: no CPU, none
    ]
    assert nodes_there(nodes, hw) == 3
    pairs = hw.model_copy(update={"workers_per_node": 2})
    assert nodes_there(nodes, pairs) == 1  # one machine hosts two
    assert nodes_there([nodes[1], nodes[1]], pairs) == 0  # two machines of one worker are no node of two
    assert nodes_there(nodes * 3, hw) == 4  # never above max_nodes
    assert should_grow(1, 2) and not should_grow(2, 2) and not should_grow(2, 1)


def test_waiting_for_nodes_settles_and_gives_up_with_the_key_to_change() -> None:
    hw = _elastic("hardware.wait_for_nodes_s=0.5").hardware
    counts = iter([2, 1, 1, 1, 1, 1])  # a lost node the cluster notices late
    assert wait_for_nodes(hw, lambda: next(counts), settle_s=0.2) == 1
    with pytest.raises(UserError) as info:
        wait_for_nodes(hw, lambda: 0)
    assert info.value.field == "hardware.min_nodes" and "no more came within 0.5 s" in info.value.problem


def _probe_forbidden(*_: object, **__: object) -> None:
    raise AssertionError("a re-plan profiled or timed the model again")


def test_a_replan_keeps_the_global_batch_runs_no_probe_and_equals_a_fresh_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = _elastic()
    # the first plan's probe is kept for the fresh one, however busy the suite keeps the host
    monkeypatch.setattr(model_probe, "quiet", lambda _measurement: True)
    first = plan_recipe(recipe.at_nodes(2))
    assert (first.plan.world_size, first.plan.global_batch_size, first.plan.grad_accum_steps) == (2, 16, 1)
    fresh = plan_recipe(recipe.at_nodes(1))
    with monkeypatch.context() as patched:
        patched.setattr(make_plan, "build_context", _probe_forbidden)
        patched.setattr(make_plan, "profile_model", _probe_forbidden)
        small = replan(lambda dev: build_model(recipe.model, dev), first, plan_request(recipe.at_nodes(1)))
    plan = small.plan
    assert (plan.world_size, plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (1, 16, 8, 2)
    # a world of one talks to nobody, so the first plan's measurements are all a fresh plan would use
    assert plan.model_dump(exclude={"search": {"seconds"}}) == fresh.plan.model_dump(exclude={"search": {"seconds"}})


def test_a_replan_where_nothing_fits_is_the_planners_advice() -> None:
    recipe = _elastic("hardware.memory_per_device_gb=0.004")
    first = plan_recipe(recipe.at_nodes(2))
    with pytest.raises(NoPlanFits) as info:
        replan(lambda dev: build_model(recipe.model, dev), first, plan_request(recipe.at_nodes(1)))
    assert info.value.field == "hardware.memory_per_device_gb" and info.value.advised_gb > 0.004


@pytest.mark.parametrize(("micro", "accum", "world"), [(8, 1, 2), (8, 2, 1), (4, 2, 2), (2, 8, 1), (1, 4, 4)])
def test_every_split_of_a_global_batch_trains_each_row_once(micro: int, accum: int, world: int) -> None:
    rows = [list(range(16))[rows_of(m, r, micro, world)] for m, r in itertools.product(range(accum), range(world))]
    assert sorted(itertools.chain(*rows)) == list(range(16))


def test_a_step_feeds_the_same_samples_whatever_the_world_size() -> None:
    recipe = _elastic()
    sampler = BatchSampler(load_tokens(recipe.data, 0), recipe.data.seq_len, 0)
    for step in (0, 5):
        two = [next(iter(sampler.micro_batches(step, 1, 8, rank, 2)))[0] for rank in range(2)]
        one = [x for x, _ in sampler.micro_batches(step, 2, 8, 0, 1)]
        assert torch.equal(torch.cat(two), torch.cat(one))
        assert torch.equal(torch.cat(one), sampler.global_batch(step, 16)[0])
    assert not torch.equal(sampler.global_batch(0, 16)[0], sampler.global_batch(1, 16)[0])


@pytest.mark.parametrize(
    ("overrides", "hosts", "refused"),
    [
        (["hardware.workers_per_node=2"], [4], False),  # one machine hosts the plan's node
        (["hardware.workers_per_node=2", "hardware.nodes=2"], [2, 2, 1], False),
        (["hardware.workers_per_node=4", "hardware.nodes=2"], [8, 4], False),  # a larger machine: Ray packs it
        (["hardware.workers_per_node=4"], [2, 2], True),  # one plan node over two machines
        (["hardware.workers_per_node=2", "hardware.nodes=2"], [2, 1, 1], True),
    ],
)
def test_a_plan_node_must_fit_on_one_machine(overrides: list[str], hosts: list[int], refused: bool) -> None:
    hw = load_recipe(RECIPES / "tiny.yaml", overrides).hardware
    if not refused:
        check_nodes_host_the_plan(hosts, hw)
        return
    with pytest.raises(UserError) as caught:
        check_nodes_host_the_plan(hosts, hw)
    assert caught.value.field == "hardware.workers_per_node" and caught.value.value == hw.workers_per_node
    assert str(sorted(hosts, reverse=True)) in caught.value.problem and f"({max(hosts)})" in caught.value.fix
