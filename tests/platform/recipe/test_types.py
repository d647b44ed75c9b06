"""A value of the wrong type is refused as one message naming the key, the value and the type the key takes."""

import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel

from helpers import CLI, RECIPES
from osdp_planners.errors import UserErrors
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.recipe.schema import Recipe
from osdp_platform.recipe.typetext import takes_number

TINY = RECIPES / "tiny.yaml"


def _number_keys() -> list[str]:
    """Every key of the schema that takes an int or a float, found from the schema (a new one is covered)."""
    keys = []
    for section, info in Recipe.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            keys += [f"{section}.{key}" for key, sub in model.model_fields.items() if takes_number(sub.annotation)]
    return keys


def _only_error(overrides: list[str]) -> tuple[str, object, str, str]:
    with pytest.raises(UserErrors) as info:
        load_recipe(TINY, overrides)
    assert len(info.value.errors) == 1, str(info.value)
    err = info.value.errors[0]
    return err.field, err.value, err.problem, err.fix


def test_the_number_keys_include_the_ints_and_floats_qa_found() -> None:
    keys = _number_keys()
    assert {"train.steps", "train.micro_batch_size", "hardware.workers_per_node", "train.lr"} <= set(keys)
    assert "train.compile" not in keys and "model.kwargs" not in keys


@pytest.mark.parametrize("key", _number_keys())
@pytest.mark.parametrize("flag", ["true", "false"])
def test_a_boolean_is_refused_where_a_number_is_expected(key: str, flag: str) -> None:
    field, value, problem, fix = _only_error([f"{key}={flag}"])
    assert (field, value) == (key, flag == "true")
    assert "not true or false" in problem and ("int" in problem or "float" in problem), problem
    assert "type" in fix


def test_the_cli_refuses_a_boolean_step_count_with_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [CLI, "validate", str(TINY), "train.steps=true"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout
    assert "train.steps = True: Input should be int > 0, not true or false" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("override", "key", "value", "expected"),
    [
        ("train.micro_batch_size=0", "train.micro_batch_size", 0, "int > 0 or auto"),
        ("train.micro_batch_size=autox", "train.micro_batch_size", "autox", "int > 0 or auto"),
        ("model.hf_config=5", "model.hf_config", 5, "mapping or str or null"),
    ],
)
def test_a_union_key_gets_one_message_without_pydantics_member_tags(
    override: str, key: str, value: object, expected: str
) -> None:
    """pydantic reports a union's value once per member (`train.micro_batch_size.constrained-int`, then
    `Input should be 'auto'`): the user wrote one value, and reads one message naming what the key takes."""
    field, found, problem, fix = _only_error([override])
    assert (field, found) == (key, value)
    assert problem == f"Input should be {expected}" and expected in fix


@pytest.mark.parametrize(
    ("overrides", "device"),
    [
        (
            ["planner.memory_limit_gb=0.008", "hardware.memory_per_device_gb=0.002"],
            "hardware.memory_per_device_gb = 0.002",
        ),
        (["planner.memory_limit_gb=90", "hardware.memory_per_device_gb=null"], "hardware.preset = cpu (8 GiB)"),
    ],
)
def test_a_budget_above_the_device_memory_is_refused(overrides: list[str], device: str) -> None:
    """planner.memory_limit_gb is a per-device budget (the README's reference): it cannot exceed the device."""
    field, value, problem, fix = _only_error(overrides)
    assert field == "planner.memory_limit_gb" and value == float(overrides[0].split("=")[1])
    assert device in problem and "per-device budget" in problem, problem
    assert "at most" in fix and "hardware.memory_per_device_gb" in fix, fix


def test_a_budget_of_the_device_memory_or_less_is_taken() -> None:
    recipe = load_recipe(TINY, ["planner.memory_limit_gb=0.002", "hardware.memory_per_device_gb=0.002"])
    assert recipe.memory_limit_bytes == recipe.hardware.memory_per_device_bytes


ZOO_OPTIONS = "vocab_size: int, dim: int, n_layers: int, n_heads: int"


@pytest.mark.parametrize(
    ("override", "key", "value", "expected"),
    [
        ("model.kwargs.n_layers=abc", "model.kwargs.n_layers", "abc", "int"),
        ("model.kwargs.n_layers=2.5", "model.kwargs.n_layers", 2.5, "int"),
        ("model.kwargs.n_layers=true", "model.kwargs.n_layers", True, "int"),
        ("model.kwargs.n_kv_heads=two", "model.kwargs.n_kv_heads", "two", "int or null"),
        ("model.kwargs.norm_eps=small", "model.kwargs.norm_eps", "small", "float"),
    ],
)
def test_a_zoo_option_of_the_wrong_type_is_named_with_the_options(
    override: str, key: str, value: object, expected: str
) -> None:
    """The zoo model's constructor would fail with Python's own words (`'<=' not supported between ...`)."""
    field, found, problem, fix = _only_error([override])
    assert (field, found) == (key, value)
    assert problem == f"Input should be {expected}"
    assert ZOO_OPTIONS in fix and "not supported" not in problem + fix, fix


def test_an_unknown_zoo_option_is_named_with_the_options() -> None:
    field, value, problem, fix = _only_error(["model.kwargs.n_layerz=2"])
    assert (field, value) == ("model.kwargs.n_layerz", 2) and "not an option" in problem
    assert ZOO_OPTIONS in fix and "norm_eps: float" in fix


def test_zoo_options_of_their_types_build_the_model() -> None:
    recipe = load_recipe(
        TINY, ["model.kwargs.n_layers=3", "model.kwargs.norm_eps=1e-6", "model.kwargs.n_kv_heads=null"]
    )
    assert recipe.model.kwargs["n_layers"] == 3 and recipe.model.kwargs["norm_eps"] == 1e-6


def test_the_cli_names_a_zoo_options_type_with_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [CLI, "validate", str(TINY), "model.kwargs.n_layers=abc"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout
    assert "model.kwargs.n_layers = 'abc': Input should be int" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "not supported" not in done.stderr
