"""The recipe reference is the schema's: the README block, `make docs` and `validate --explain` render it."""

from pathlib import Path

import pytest

from helpers import RECIPES, REPO
from osdp_planners.hardware import PRESETS
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.recipe import docs as recipe_docs
from osdp_platform.recipe.schema import Recipe
from osdp_platform.zoo import zoo_sizes


def test_readme_reference_matches_the_schema() -> None:
    readme = REPO / "README.md"
    assert recipe_docs.current_block(readme) == recipe_docs.readme_block(), (
        "README.md's recipe reference differs from platform/osdp_platform/recipe/{schema,inputs,pool}.py: "
        "run `make docs` (or .venv/bin/python -m osdp_platform.recipe.docs --write README.md) and commit the result"
    )


def test_every_recipe_field_has_a_description() -> None:
    missing = [
        f"{section.name}.{key}" if section.name else key
        for section in recipe_docs.sections()
        for key in section.keys
        if not key.meaning
    ]
    missing += [name for name, info in Recipe.model_fields.items() if not info.description]
    assert not missing, f"add Field(description=...) in osdp_platform/recipe/schema.py or inputs.py for {missing}"


def _keys() -> dict[str, recipe_docs.Key]:
    return {key.path: key for section in recipe_docs.sections() for key in section.keys}


@pytest.mark.parametrize(
    ("path", "type_", "default"),
    [
        ("name", "str", "`run`"),
        ("data.source", "`synthetic` or `corpus` or `text_file` or `token_files`", "`corpus`"),
        ("data.seq_len", "int >= 2", "`64`"),
        ("hardware.nodes", "int > 0", "`1`"),
        ("hardware.autoscaling", "bool", "`false`"),
        ("hardware.memory_per_device_gb", "float > 0 or null", "`null`"),
        ("hardware.wait_for_nodes_s", "float > 0", "`600`"),
        ("planner.memory_margin", "0 <= float < 0.5 or null", "`null`"),
        ("model.hf_config", "mapping or str or null", "`null`"),
        ("model.kwargs", "mapping", "`{}`"),
        ("train.micro_batch_size", "int > 0 or `auto`", "`4`"),
        ("train.lr", "float > 0", "`0.001`"),
        ("train.max_failures", "int >= -1", "`1`"),
    ],
)
def test_types_bounds_and_defaults_read_as_a_recipe_writes_them(path: str, type_: str, default: str) -> None:
    key = _keys()[path]
    assert (key.type, key.default) == (type_, default)


def test_every_section_and_key_is_listed_in_schema_order() -> None:
    names = [section.name for section in recipe_docs.sections()]
    assert names == ["", "model", "data", "hardware", "planner", "train", "tracking"]
    train = next(s for s in recipe_docs.sections() if s.name == "train")
    assert [k.path for k in train.keys][:3] == ["train.steps", "train.micro_batch_size", "train.global_batch_size"]
    assert len(_keys()) == 1 + 5 + 4 + 10 + 9 + 13 + 3


def test_value_lists_in_descriptions_cover_the_zoo_and_the_presets() -> None:
    """`model.size` lists the zoo by hand: a new family or size must be added there too."""
    sizes = _keys()["model.size"].meaning
    for family, names in zoo_sizes().items():
        listed = sizes.split(f"{family} ", 1)[1].split(";", 1)[0].split(", ")
        assert listed == names, f"model.size's description lists {family} {listed}, the zoo has {names}"
    assert all(name in _keys()["hardware.preset"].meaning for name in PRESETS)


def test_write_replaces_only_the_block_and_refuses_a_file_without_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{recipe_docs.START}\n| stale | table |\n{recipe_docs.END}\n\nafter\n")
    assert recipe_docs.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "stale" not in text
    assert "| `train.checkpoint_every` | int >= 0 | `0` | steps between checkpoints; 0 = never |" in text
    assert recipe_docs.write_readme(readme) is False  # idempotent
    no_markers = tmp_path / "OTHER.md"
    no_markers.write_text("# no block here\n")
    with pytest.raises(SystemExit, match="recipe-reference:start"):
        recipe_docs.write_readme(no_markers)


def test_validate_explain_prints_the_reference(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    assert main(["validate", "--explain"]) == 0
    out = capsys.readouterr().out
    for path in _keys():
        assert path in out
    assert "optimizer steps" in out
    assert "this recipe" not in out


def test_validate_explain_with_a_recipe_shows_its_values(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["validate", str(RECIPES / "tiny.yaml"), "train.steps=7", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "this recipe" in out
    steps = next(line for line in out.splitlines() if "train.steps " in line).split()
    assert steps[:6] == ["train.steps", "int", ">", "0", "20", "7"]
    assert "is valid" in out
    assert main(["validate", str(RECIPES / "tiny.yaml"), "train.steps=0", "--explain"]) == EXIT_USER_ERROR
    assert "train.steps" in capsys.readouterr().err


def test_validate_without_a_recipe_or_explain_is_a_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "recipe" in err and "--explain" in err
