"""Any model a user brings: discovery, planning under every planner, training, and clear refusals.

The structures (tests/support/structures.py) are planned by every planner on the fake-tensor profiler, then
one Ray Train fit on 2 gloo workers trains, per structure, OSDP's plan, ZeRO-3's and a plan that mixes
every strategy unit by unit (also split where SPLIT_CASES says) with the shipped step and apply_plan;
each loss curve and the final parameters must match one plain-torch process fed the whole global batch.
SGD, because it passes a gradient's scale straight into the parameters (a unit gathered twice and
reduced twice must still sum to the right gradient).
"""

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from helpers import RECIPES
from osdp_planners import make_plan_for
from osdp_planners.errors import UserError
from osdp_planners.plan import Plan, Strategy
from osdp_planners.profiler import profile_model
from osdp_planners.step_layout import layout_of
from osdp_planners.uniform import group_size
from osdp_planners.units import ROOT, find_units
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.schema import ModelSection, Recipe
from osdp_platform.runtime.data import load_tokens
from osdp_platform.runtime.models import build_model
from osdp_platform.runtime.state import build_worker_state
from reference import reference_run
from structures import STRUCTURES

pytestmark = pytest.mark.heavy

PLANNERS = ("osdp", "ddp", "zero2", "zero3", "hsdp")
WORLD = 2
STEPS = 4
MICRO_BATCH = 2
SEQ_LEN = 16
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
MIXED = (Strategy.ZERO3, Strategy.DDP, Strategy.ZERO2, Strategy.HSDP)
SPLIT_CASES = {"plain_linears": (2, 4), "hf_like": (2, 4), "root_params_buffer": (4,)}

# Expected units, written out by hand from the rules in planners/osdp_planners/units.py.
EXPECTED_UNITS = {
    "moduledict_gpt": [
        "transformer.wte+lm_head",
        "transformer.wpe",
        "transformer.h.0.ln_1+attn",
        "transformer.h.0.ln_2+mlp",
        "transformer.h.1.ln_1+attn",
        "transformer.h.1.ln_2+mlp",
        ROOT,
    ],  # ln_f: a norm outside blocks
    "nested_sequential": [
        "embed",
        "stages.0.0.norm+up",
        "stages.0.0.down",
        "stages.0.1.norm+up",
        "stages.0.1.down",
        "stages.1.0.norm+up",
        "stages.1.0.down",
        "head.0",
        "head.2",
        ROOT,
    ],
    "unequal_widths": [
        "blocks.0.norm+proj",
        "blocks.0.mix",
        "blocks.1.norm+proj",
        "blocks.1.mix",
        ROOT,
    ],  # the embedding's weight is read by the root's forward
    "root_params_buffer": [
        "embed",
        "blocks.0.norm+up",
        "blocks.0.down",
        "blocks.1.norm+up",
        "blocks.1.down",
        "lm_head",
        ROOT,
    ],  # gain and the never-run `unused`
    "tied_across": ["parts.embed+head", "blocks.0.norm+down", "blocks.0.up+blocks.1.up", "blocks.1.norm+down", ROOT],
    "reused_block": [
        "embed",
        "blocks.0.ln_1",
        "blocks.0.attn",
        "blocks.0.ln_2",
        "blocks.0.mlp",
        "blocks.1.norm",
        "blocks.1.ff",
        "head",
    ],  # run twice: no groups
    "hf_like": [
        "model.embed_tokens",
        "model.layers.0.self_attn+input_layernorm",
        "model.layers.0.mlp+post_attention_layernorm",
        "model.layers.1.self_attn+input_layernorm",
        "model.layers.1.mlp+post_attention_layernorm",
        "lm_head",
        ROOT,
    ],
    "plain_linears": ["embed", "blocks.0.mix", "blocks.0.mlp", "blocks.1.mix", "blocks.1.mlp", "head"],
    "opaque_output": ["embed", "blocks.0.proj", "blocks.1.proj", "head", ROOT],  # each mlp returns a plain object
    "torch_encoder": [
        "embed",
        "encoder.layers.0.self_attn",
        "encoder.layers.0.linear1+norm1",
        "encoder.layers.0.linear2+norm2",
        "encoder.layers.1.self_attn",
        "encoder.layers.1.linear1+norm1",
        "encoder.layers.1.linear2+norm2",
        "head",
    ],  # built by copy.deepcopy of one layer; the norms run after attention and MLP (post-norm)
}


def _model(structure: str) -> dict[str, Any]:
    return {"target": f"structures:{STRUCTURES[structure].__name__}"}


def _recipe(structure: str, planner: str = "osdp") -> Recipe:
    return Recipe.model_validate(
        {
            "model": _model(structure),
            "data": {"source": "corpus", "seq_len": SEQ_LEN},
            "hardware": {"workers_per_node": WORLD, "memory_per_device_gb": 1.0},
            "planner": {"name": planner},
            "train": {
                "steps": STEPS,
                "micro_batch_size": MICRO_BATCH,
                "optimizer": "sgd",
                "lr": 0.1,
                "weight_decay": 0.01,
            },
        }
    )


def _plan(structure: str, planner: str) -> Plan:
    recipe = _recipe(structure, planner)
    return make_plan_for(lambda dev: build_model(recipe.model, dev), plan_request(recipe), measure_on=None).plan


def _split_plan(base: Plan, split: int) -> Plan:
    """Every unit split `split` ways where it has Linears, strategies mixed unit by unit."""
    req = plan_request(_recipe("plain_linears"))
    units = [
        u.model_copy(
            update={
                "split": split if u.name != ROOT else 1,
                "strategy": MIXED[i % len(MIXED)],
                "shard_group_size": group_size(MIXED[i % len(MIXED)], req),
            }
        )
        for i, u in enumerate(base.units)
    ]
    return base.model_copy(update={"units": units})


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_units_follow_the_rules(structure: str) -> None:
    with torch.device("meta"):
        model = STRUCTURES[structure]()
    units = find_units(model, SEQ_LEN, 256)
    assert [u.name for u in units] == EXPECTED_UNITS[structure]
    assert sum(u.param_count for u in units) == sum(p.numel() for p in model.parameters())


def test_profiler_records_every_call_of_a_module_run_twice() -> None:
    def build(device: str) -> torch.nn.Module:
        with torch.device(device):
            return STRUCTURES["reused_block"]()

    profile = profile_model(build, SEQ_LEN, 256)
    paths = [m.path for m in profile.modules]
    assert paths.count("blocks.0.attn") == 2 and paths.count("blocks.1.ff") == 2 and paths.count("embed") == 1
    first, second = (m for m in profile.modules if m.path == "blocks.0.attn")
    assert first.fwd_flops.at(1) == second.fwd_flops.at(1) > 0
    events = layout_of(profile).units[first.unit]  # each call is an event of its own in the simulated step
    assert {first.key, second.key} <= set(events.forward) and first.key != second.key
    assert events.forward[first.key] < events.forward[second.key]
    assert events.backward[second.key] < events.backward[first.key]  # backward runs the calls in reverse


def _train_cases(config: dict[str, Any]) -> None:
    """Worker loop: every case from the same seed and data; rank 0 sends losses and full parameters."""
    import ray.train

    torch.set_num_threads(1)
    recipe = Recipe.model_validate(config["recipe"])
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    tokens = load_tokens(recipe.data, recipe.train.seed)
    results: dict[str, dict[str, Any]] = {}
    for name, (model_json, plan_json) in config["cases"].items():
        case = recipe.model_copy(update={"model": ModelSection.model_validate(model_json)})
        state = build_worker_state(case, Plan.model_validate(plan_json), torch.device("cpu"), tokens=tokens)
        losses = []
        for step in range(STEPS):
            mean = state.step(step, rank, world)
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        params = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[name] = {"losses": losses, "params": params}
    dist.barrier()
    if rank == 0:
        config["results"].put(results)


def _reference(structure: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    recipe = _recipe(structure)
    return reference_run(lambda: build_model(recipe.model), recipe, MICRO_BATCH * WORLD, STEPS)


def test_every_structure_and_planner_trains_like_one_process(ray_cluster: None) -> None:
    start = time.perf_counter()
    cases: dict[str, tuple[dict[str, Any], Plan]] = {}
    for structure in STRUCTURES:
        plans = {planner: _plan(structure, planner) for planner in PLANNERS}  # every planner plans every model
        # trained: OSDP's plan, uniform ZeRO-3, and every strategy at once (one per unit, in turn), unsplit and
        # split; each uniform plan is one of these strategies on every unit (CI time: 32 cases, not 50)
        cases[f"{structure}/osdp"] = (_model(structure), plans["osdp"])
        cases[f"{structure}/zero3"] = (_model(structure), plans["zero3"])
        for split in (1, *SPLIT_CASES.get(structure, ())):
            cases[f"{structure}/mixed-split{split}"] = (_model(structure), _split_plan(plans["zero3"], split))
    plan_seconds = time.perf_counter() - start
    splits = {n: {u.name: u.split for u in p.units if u.split > 1} for n, (_, p) in cases.items() if "split" in n}
    assert splits["plain_linears/mixed-split4"]["blocks.0.mlp"] == 4 and splits["hf_like/mixed-split2"]["lm_head"] == 2

    queue = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        _train_cases,
        train_loop_config={
            "recipe": _recipe("plain_linears").model_dump(mode="json"),
            "results": queue,
            "cases": {n: (m, p.model_dump(mode="json")) for n, (m, p) in cases.items()},
        },
        scaling_config=ScalingConfig(num_workers=WORLD),
    )
    trainer.fit()
    results = queue.get(timeout=30)
    fit_seconds = time.perf_counter() - start - plan_seconds

    report, failed = [], []
    references = {s: _reference(s) for s in STRUCTURES}
    for name in cases:
        ref_losses, ref_params = references[name.split("/")[0]]
        got = results[name]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses, strict=True))
        assert list(got["params"]) == list(ref_params), name
        param_diff = max(float((got["params"][k] - ref_params[k]).abs().max()) for k in ref_params)
        report.append(f"{name}: loss rel {loss_diff:.1e}, params abs {param_diff:.1e}")
        if loss_diff > LOSS_RTOL or param_diff > PARAM_ATOL:
            failed.append(name)
    print(f"\n{len(cases)} cases: planning {plan_seconds:.0f} s, fit {fit_seconds:.0f} s\n" + "\n".join(report))
    assert not failed, "\n".join(report)
    for structure, (losses, _) in references.items():
        assert losses[-1] < losses[0], f"{structure}: the reference did not learn"


def _plan_cli(structure_class: str, tmp_path: Path, *extra: str) -> list[str]:
    """`plan` on a GPU preset: no CPU timing probes run, the fake-tensor profile is all it needs."""
    return [
        "plan",
        str(RECIPES / "tiny.yaml"),
        "model.family=null",
        "model.size=null",
        f"model.target=structures:{structure_class}",
        "hardware.accelerator=gpu",
        "hardware.preset=a100-80gb",
        "hardware.memory_per_device_gb=null",
        f"data.seq_len={SEQ_LEN}",
        *extra,
    ]


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_plan_command_prints_the_unit_table(structure: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main(_plan_cli(STRUCTURES[structure].__name__, tmp_path, "--out", str(out)))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    plan = Plan.from_file(out)
    assert [u.name for u in plan.units] == EXPECTED_UNITS[structure]
    table = printed.out[printed.out.index(": plan by osdp") :]
    assert all(name[:20] in table for name in EXPECTED_UNITS[structure])
    assert "best uniform plan" in printed.out


BAD_MODELS = [
    ("ValueBranch", "blocks.1", "ValueGate: forward raised"),
    ("SmallVocab", ROOT, "the logits cover 100 tokens, the data has 256"),
]


@pytest.mark.parametrize(("factory", "module", "problem"), BAD_MODELS)
def test_plan_refuses_an_unplannable_model_with_one_message(
    factory: str, module: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(_plan_cli(factory, tmp_path))
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR, err
    assert f"model = '{module}'" in err and problem in err and "fix:" in err and "forward(tokens)" in err
    assert "Traceback" not in err


def test_validate_refuses_a_model_whose_forward_fails_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """`validate` starts nothing, so the refusal comes from the driver's own trace of the forward."""
    code = main(["validate", *_plan_cli("ValueBranch", Path())[1:]])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR, err
    assert "model = 'blocks.1'" in err and "ValueGate: forward raised" in err and "fix:" in err


def test_submit_refuses_an_unplannable_model_from_the_planner_actor(
    ray_cluster: None, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The logits' width is checked against the data's vocabulary by the planner on its sample worker: the
    refusal crosses Ray as the same one message."""
    code = main(
        [
            "submit",
            str(RECIPES / "tiny.yaml"),
            "model.family=null",
            "model.size=null",
            "model.target=structures:SmallVocab",
            f"data.seq_len={SEQ_LEN}",
            f"tracking.uri=sqlite:///{workdir}/m.db",
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR, err
    assert "model = '<root>'" in err and "the logits cover 100 tokens, the data has 256" in err and "fix:" in err
    assert "Traceback" not in err and "RayTaskError" not in err
    assert not (workdir / "m.db").exists()


def test_a_failure_anywhere_in_planning_is_one_user_error() -> None:
    """An exception from deep inside planning (here the model's own constructor) is a UserError too."""

    def build(_device: str) -> torch.nn.Module:
        raise RuntimeError("cannot allocate the table")

    with pytest.raises(UserError, match="cannot allocate the table") as info:
        make_plan_for(build, plan_request(_recipe("plain_linears")), measure_on=None)
    assert info.value.field == "model" and "test_any_model.py" in info.value.problem


def test_a_manual_plan_naming_other_units_is_refused(tmp_path: Path) -> None:
    recipe = _recipe("plain_linears")
    plan = _plan("plain_linears", "zero3")
    merged = plan.units[0].model_copy(update={"name": "embed+blocks.0.mix", "modules": ["embed", "blocks.0.mix"]})
    edited = tmp_path / "edited.json"
    edited.write_text(plan.model_copy(update={"units": [merged, *plan.units[2:]]}).to_json())
    req = dataclasses.replace(plan_request(recipe), planner="manual", plan_file=str(edited))
    with pytest.raises(UserError, match="this model's units are") as info:
        make_plan_for(lambda dev: build_model(recipe.model, dev), req, measure_on=None)
    assert info.value.field == "planner.plan_file"


def test_the_example_model_recipe_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """recipes/nanogpt.yaml as the README runs it (its folder on the path), on a GPU preset."""
    monkeypatch.syspath_prepend(str(RECIPES))
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            str(RECIPES / "nanogpt.yaml"),
            "hardware.accelerator=gpu",
            "hardware.preset=a100-80gb",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    blocks = [f"transformer.h.{i}.{pair}" for i in range(4) for pair in ("ln_1+attn", "ln_2+mlp")]
    assert [u.name for u in Plan.from_file(out).units] == ["transformer.wte+lm_head", "transformer.wpe", *blocks, ROOT]
