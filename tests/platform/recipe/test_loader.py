"""Recipe loading and validation: every user mistake is one clear message, exit code 2, nothing started."""

import subprocess
from pathlib import Path

import pytest

from helpers import CLI, RECIPES
from osdp_planners.errors import UserError, UserErrors
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.loader import flatten, load_recipe


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BASE = """
name: base
model: {family: llama, size: tiny}
hardware: {workers_per_node: 2, memory_per_device_gb: 2}
train: {steps: 7, micro_batch_size: 2}
"""


def test_every_shipped_recipe_validates() -> None:
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert {"tiny.yaml", "llama.yaml", "llama-70b.yaml", "gpt2.yaml", "opt.yaml"} <= set(names)
    for path in RECIPES.glob("*.yaml"):
        recipe = load_recipe(path)
        assert recipe.hardware.world_size >= 1


def test_extends_interpolation_and_overrides(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", BASE)
    child = write(
        tmp_path / "child.yaml",
        "extends: base.yaml\nname: child\ntrain: {lr: 0.01}\ndata: {seq_len: '${train.steps}'}\n",
    )
    recipe = load_recipe(child, ["train.steps=5", "hardware.nodes=2"])
    assert recipe.name == "child"
    assert recipe.train.steps == 5
    assert recipe.train.lr == 0.01
    assert recipe.train.micro_batch_size == 2  # inherited from the base
    assert recipe.data.seq_len == 5  # interpolated after the override
    assert recipe.hardware.world_size == 4
    assert flatten(recipe)["hardware.nodes"] == "2"
    assert plan_request(recipe).search == "auto"
    assert plan_request(load_recipe(child, ["planner.search=milp"])).search == "milp"  # reaches the planner
    assert plan_request(recipe).prefer_simpler is True
    assert plan_request(load_recipe(child, ["planner.prefer_simpler=false"])).prefer_simpler is False
    with pytest.warns(FutureWarning, match="renamed knapsack"):  # the old name, for one release
        assert plan_request(load_recipe(child, ["planner.search=dp"])).search == "knapsack"


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["train.stepz=5"], "train.stepz", "steps, micro_batch_size"),
        (["hardware.nodes=two"], "hardware.nodes", "valid integer"),
        (["planner.name=fastest"], "planner.name", "zero3"),
        (["planner.search=exact"], "planner.search", "milp"),
        (["hardware.preset=tpu-v9"], "hardware", "tpu-v9"),
        (["data.source=text_file", "data.path=/no/such/file.txt"], "data", "/no/such/file.txt"),
        (["train.global_batch_size=6"], "", "multiple of micro_batch_size"),
        (["hardware.memory_per_device_gb=1", "planner.memory_reserve_gb=2"], "planner.memory_reserve_gb", "lower it"),
        (["model.target=nomodule"], "model", "more than one model source"),
        (["model.family=null", "model.size=null", "model.target=nomodule"], "model", "package.module:factory"),
    ],
)
def test_bad_values_name_field_value_and_fix(tmp_path: Path, overrides: list[str], field: str, words: str) -> None:
    path = write(tmp_path / "r.yaml", BASE)
    with pytest.raises(UserErrors) as info:
        load_recipe(path, overrides)
    text = str(info.value)
    assert field in text
    assert words in text
    assert "fix:" in text


def test_missing_recipe_and_bad_override_syntax(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    path = write(tmp_path / "r.yaml", BASE)
    with pytest.raises(UserError, match="key=value"):
        load_recipe(path, ["train.steps"])


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_exit_code_2_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yaml", BASE)
    result = run_cli("submit", str(path), "train.optimizer=lion", cwd=tmp_path)
    assert result.returncode == 2
    assert "train.optimizer" in result.stderr and "lion" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "mlflow.db").exists()  # nothing started, nothing written


def test_gpu_pool_on_machine_without_gpus_fails_fast(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yaml", BASE)
    result = run_cli(
        "submit",
        str(path),
        "hardware.accelerator=gpu",
        "hardware.preset=a100-80gb",
        "hardware.workers_per_node=8",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "needs 8 GPUs" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_existing_tracking_store_untouched_by_bad_submit(tmp_path: Path) -> None:
    store = write(tmp_path / "mlflow.db", "precious")
    path = write(tmp_path / "r.yaml", BASE)
    result = run_cli("submit", str(path), "train.steps=-1", cwd=tmp_path)
    assert result.returncode == 2
    assert store.read_text() == "precious"


def test_validate_prints_resolved_recipe(tmp_path: Path) -> None:
    result = run_cli("validate", str(RECIPES / "tiny.yaml"), "train.steps=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "steps: 3" in result.stdout


def test_user_errors_survive_pickling_with_their_fields() -> None:
    """Errors cross Ray (planner actor, workers) by pickle: the type, fields and message must come back."""
    import pickle

    one = UserError("planner.memory_limit_gb", 0.5, "no plan fits", "raise it")
    back = pickle.loads(pickle.dumps(one))
    assert type(back) is UserError and str(back) == str(one)
    assert (back.field, back.value, back.problem, back.fix) == (
        "planner.memory_limit_gb",
        0.5,
        "no plan fits",
        "raise it",
    )
    many = pickle.loads(pickle.dumps(UserErrors("r.yaml", [one, one])))
    assert str(many) == str(UserErrors("r.yaml", [one, one])) and len(many.errors) == 2
