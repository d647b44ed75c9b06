"""A battery of user mistakes: each gets one message naming the key or file, exit 2, and nothing starts.

Every case runs the CLI's `main` in this process, in a fresh folder, with tracking pointed at a
sqlite file there: the message must name what the user wrote (a key or a file), hold no traceback,
and leave no Ray, no MLflow store and no `runs/` folder behind. Recipe syntax and schema mistakes,
data files, model factories, plan files and pools are all found before Ray would start.
"""

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import ray

from helpers import RECIPES
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.runtime.data import TokenFiles

TINY = str(RECIPES / "tiny.yaml")
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 20


@dataclass(frozen=True)
class Case:
    argv: Callable[[Path], list[str]]  # the command line, given the case's folder
    names: str  # what the message must name: a key, a file, or the words that give the cause


def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _recipe(folder: Path, text: str) -> str:
    return str(_write(folder / "recipe.yaml", text))


def _tokens(folder: Path, edit: Callable[[Path], None] = lambda _f: None) -> str:
    """A prepared token folder (bytes tokenizer, uint16), then `edit` breaks it."""
    out = folder / "tokens"
    TokenFiles.prepare([_write(folder / "a.txt", TEXT)], "bytes", out)
    edit(out)
    return str(out)


def _bin(out: Path) -> Path:
    return next(out.glob("*.bin"))


def _plan_json(folder: Path, **fields: object) -> str:
    plan = {"version": 1, "planner": "osdp", "model": "x", "world_size": 2, "units": [], **fields}
    return str(_write(folder / "plan.json", json.dumps(plan)))


def _factory(folder: Path, name: str, body: str) -> str:
    """A model factory module of the user's, `name` unique per case (imported modules stay cached)."""
    _write(folder / f"{name}.py", f"def build(**kwargs):\n    {body}\n")
    return f"{name}:build"


def _on_tiny(*overrides: str, command: str = "validate") -> Callable[[Path], list[str]]:
    return lambda _folder: [command, TINY, *overrides]


def _token_case(edit: Callable[[Path], None], names: str, *extra: str) -> Case:
    return Case(lambda f: ["validate", TINY, "data.source=token_files", f"data.path={_tokens(f, edit)}", *extra], names)


CASES: dict[str, Case] = {
    # recipe files and YAML syntax
    "recipe missing": Case(lambda f: ["validate", str(f / "nope.yaml")], "nope.yaml"),
    "recipe is a folder": Case(lambda f: ["validate", str(f)], "is a folder"),
    "tab in yaml": Case(lambda f: ["validate", _recipe(f, "model:\n\tfamily: llama\n")], "line 2, column 1"),
    "bad indentation": Case(
        lambda f: ["validate", _recipe(f, "model:\n  family: llama\n size: tiny\n")], "recipe.yaml"
    ),
    "binary recipe": Case(lambda f: ["validate", str(_write(f / "r.yaml", bytes(range(256))))], "r.yaml"),
    "yaml list": Case(lambda f: ["validate", _recipe(f, "- model\n- data\n")], "mapping of sections"),
    "empty recipe": Case(lambda f: ["validate", _recipe(f, "")], "add model to the recipe"),
    "extends missing": Case(lambda f: ["validate", _recipe(f, "extends: base.yaml\n")], "extends"),
    "extends cycle": Case(lambda f: ["validate", _recipe(f, "extends: recipe.yaml\n")], "too deep"),
    "interpolation": Case(lambda f: ["validate", _recipe(f, "name: ${nothing.here}\n")], "interpolation"),
    # overrides
    "override unclosed list": Case(_on_tiny("train.steps=[5"), "train.steps=[5"),
    "override without =": Case(_on_tiny("train.steps"), "train.steps"),
    "unknown key": Case(_on_tiny("train.stepz=5"), "train.stepz"),
    "unknown section": Case(_on_tiny("foo.bar=1"), "foo"),
    "wrong type": Case(_on_tiny("train.steps=abc"), "train.steps"),
    "out of bound": Case(_on_tiny("train.steps=-1"), "train.steps"),
    "bad literal": Case(_on_tiny("train.precision=fp8"), "train.precision"),
    # the model
    "unknown zoo size": Case(_on_tiny("model.size=3b"), "model.size"),
    "unknown zoo family": Case(_on_tiny("model.family=bert"), "model.family"),
    "unknown zoo option": Case(_on_tiny("model.kwargs.depth=3"), "model.kwargs"),
    "transformers field misspelt": Case(
        _on_tiny(
            "model.family=null",
            "model.size=null",
            "model.hf_config.model_type=gpt2",
            "model.hf_config.n_embd=64",
            "model.hf_config.n_head=4",
            "model.hf_config.vocab_size=256",
            "model.hf_config.n_layr=1",
        ),
        "model.hf_config.n_layr = 1: is not a field of GPT2Config",
    ),
    "zoo options that disagree": Case(
        _on_tiny("model.kwargs.dim=65"), "the llama/tiny preset has vocab_size=256, dim=64"
    ),
    "two sources": Case(_on_tiny("model.target=x:y"), "model"),
    "target without colon": Case(
        _on_tiny("model.family=null", "model.size=null", "model.target=nocolon"), "model.target"
    ),
    "target not importable": Case(
        _on_tiny("model.family=null", "model.size=null", "model.target=no_such_module:build"), "no_such_module"
    ),
    "target returns no module": Case(
        lambda f: [
            "validate",
            TINY,
            "model.family=null",
            "model.size=null",
            f"model.target={_factory(f, 'returns_int', 'return 3')}",
        ],
        "model.target",
    ),
    "target raises": Case(
        lambda f: [
            "plan",
            TINY,
            "model.family=null",
            "model.size=null",
            f"model.target={_factory(f, 'raises', 'raise RuntimeError(' + repr('bad width') + ')')}",
        ],
        "bad width",
    ),
    "hf config missing": Case(
        _on_tiny("model.family=null", "model.size=null", "model.hf_config=/no/config.json"), "model.hf_config"
    ),
    "hf config unknown type": Case(
        _on_tiny("model.family=null", "model.size=null", "model.hf_config.model_type=nosuchmodel"), "model.hf_config"
    ),
    "hf config fields disagree": Case(  # phi3's default pad_token_id (32000) is past the vocabulary
        _on_tiny(
            "model.family=null", "model.size=null", "model.hf_config.model_type=phi3", "model.hf_config.vocab_size=300"
        ),
        "pad_token_id must be `None` or an integer within the vocabulary",
    ),
    "hf config not a causal lm": Case(  # t5 is an encoder-decoder: AutoModelForCausalLM has no class for it
        _on_tiny("model.family=null", "model.size=null", "model.hf_config.model_type=t5"), "no causal language model"
    ),
    "hf config fails its forward": Case(  # gptj's default rotary_dim (64) exceeds this head size (64 / 4 = 16)
        _on_tiny(
            "model.family=null",
            "model.size=null",
            "model.hf_config={model_type: gptj, vocab_size: 300, n_embd: 64, n_layer: 2, n_head: 4}",
            "model.hf_config.eos_token_id=0",
            "model.hf_config.bos_token_id=0",
        ),
        "model.hf_config = ",
    ),
    "vocab below tokenizer": Case(_on_tiny("data.tokenizer=bpe", "model.kwargs.vocab_size=300"), "vocab"),
    # hardware, planner, train
    "unknown preset": Case(_on_tiny("hardware.preset=tpu-v9"), "hardware.preset"),
    "preset of another kind": Case(_on_tiny("hardware.preset=a100-80gb"), "hardware.preset"),
    "default gpu reserve above budget": Case(
        _on_tiny("hardware.accelerator=gpu", "hardware.preset=a100-80gb", "hardware.memory_per_device_gb=0.5"),
        "hardware.memory_per_device_gb",
    ),
    "global batch not a multiple": Case(_on_tiny("train.global_batch_size=10"), "train.global_batch_size"),
    "hsdp group not a divisor": Case(_on_tiny("planner.hsdp_group_size=3"), "planner.hsdp_group_size"),
    "bad pool name": Case(_on_tiny("hardware.pool=CPU"), "hardware.pool"),
    "manual without plan file": Case(_on_tiny("planner.name=manual"), "planner.plan_file"),
    "plan file missing": Case(_on_tiny("planner.name=manual", "planner.plan_file=/no/plan.json"), "planner.plan_file"),
    "plan file garbage": Case(
        lambda f: ["validate", TINY, "planner.name=manual", f"planner.plan_file={_write(f / 'p.json', '{nope')}"],
        "planner.plan_file",
    ),
    "plan file not a plan": Case(
        lambda f: ["validate", TINY, "planner.name=manual", f"planner.plan_file={_plan_json(f)}"], "not a plan JSON"
    ),
    "plan file ignored by osdp": Case(
        lambda f: ["validate", TINY, f"planner.plan_file={_write(f / 'p.json', '{}')}"], "planner.plan_file"
    ),
    "checkpoint dir unwritable": Case(_on_tiny("train.checkpoint_dir=/proc/x"), "train.checkpoint_dir"),
    "checkpoint dir under a file": Case(
        lambda f: ["validate", TINY, f"train.checkpoint_dir={_write(f / 'file', 'x')}/sub"], "train.checkpoint_dir"
    ),
    "budget fits nothing": Case(
        _on_tiny("hardware.memory_per_device_gb=0.0001", command="plan"), "hardware.memory_per_device_gb"
    ),
    "uniform budget fits nothing": Case(
        _on_tiny("planner.name=zero3", "hardware.memory_per_device_gb=0.0001", command="plan"), "no zero3 plan fits"
    ),
    "tracking folder store": Case(
        _on_tiny("tracking.uri=file:///tmp/no-store", command="submit"), "MLFLOW_ALLOW_FILE_STORE"
    ),
    "tracking server down": Case(_on_tiny("tracking.uri=http://127.0.0.1:9", command="submit"), "does not answer"),
    # data
    "text file missing": Case(_on_tiny("data.source=text_file", "data.path=/no/text.txt"), "data.path"),
    "text file is a folder": Case(
        lambda f: ["validate", TINY, "data.source=text_file", f"data.path={f}"], "is a folder"
    ),
    "text file empty": Case(
        lambda f: ["validate", TINY, "data.source=text_file", f"data.path={_write(f / 'e.txt', '')}"], "is empty"
    ),
    "text file binary": Case(
        lambda f: [
            "validate",
            TINY,
            "data.source=text_file",
            f"data.path={_write(f / 'b.txt', bytes(range(256)) * 8)}",
        ],
        "binary",
    ),
    "text shorter than a sample": Case(
        lambda f: ["validate", TINY, "data.source=text_file", f"data.path={_write(f / 's.txt', 'short text')}"],
        "data.seq_len",
    ),
    "token folder without manifest": Case(
        lambda f: ["validate", TINY, "data.source=token_files", f"data.path={f}"], "tokens.json"
    ),
    "token manifest corrupt": _token_case(lambda out: _write(out / "tokens.json", "{not json"), "tokens.json"),
    "token manifest without files": _token_case(
        lambda out: _write(out / "tokens.json", '{"format": 1}'), "tokens.json"
    ),
    "token file truncated": _token_case(lambda out: _bin(out).write_bytes(_bin(out).read_bytes()[:-1]), "multiple"),
    "token file empty": _token_case(lambda out: _bin(out).write_bytes(b""), "is empty"),
    "token file missing": _token_case(lambda out: _bin(out).unlink(), "missing"),
    "token ids beyond vocab": _token_case(
        lambda out: np.full(4096, 999, dtype=np.uint16).tofile(_bin(out)), "beyond the vocabulary"
    ),
    "token files too short": _token_case(lambda _out: None, "data.seq_len", "data.seq_len=4000"),
    "tokenizer with token files": _token_case(lambda _out: None, "data.tokenizer", "data.tokenizer=bpe"),
    "tokenizer file missing": Case(_on_tiny("data.tokenizer=/no/tokenizer.json"), "data.tokenizer"),
    # pools a local Ray cannot run (submit: refused before Ray starts)
    "too many workers per core": Case(
        _on_tiny("hardware.workers_per_node=64", command="submit"), "hardware.workers_per_node"
    ),
    "several nodes on a local ray": Case(_on_tiny("hardware.nodes=4", command="submit"), "hardware.nodes"),
    "gpus this machine lacks": Case(
        _on_tiny(
            "hardware.accelerator=gpu",
            "hardware.preset=a100-80gb",
            "hardware.memory_per_device_gb=80",
            command="submit",
        ),
        "GPUs",
    ),
    "submit a bad data file": Case(
        lambda f: ["submit", TINY, "data.source=text_file", f"data.path={_write(f / 'e.txt', '')}"], "is empty"
    ),
    "sweep a bad cell": Case(_on_tiny("model.size=tiny,3b", command="sweep"), "model.size"),
    # prepare
    "prepare empty file": Case(lambda f: ["prepare", str(_write(f / "e.txt", "")), "--out", str(f / "o")], "is empty"),
    "prepare binary file": Case(
        lambda f: ["prepare", str(_write(f / "b.bin", bytes(range(256)) * 4)), "--out", str(f / "o")], "binary"
    ),
    "prepare missing file": Case(lambda f: ["prepare", str(f / "none.txt"), "--out", str(f / "o")], "none.txt"),
    "prepare over a prepared folder": Case(
        lambda f: ["prepare", str(_write(f / "t.txt", TEXT)), "--out", _tokens(f)], "already holds"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_mistake_gets_one_message_and_starts_nothing(
    name: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    monkeypatch.syspath_prepend(str(workdir))  # the cases' own model factories
    argv = case.argv(workdir)
    before = set(os.listdir(workdir))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == EXIT_USER_ERROR, err
    assert "Ray's logs" not in out, f"the run announced Ray before refusing the recipe:\n{out}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert case.names in err, f"the message does not name {case.names!r}:\n{err}"
    assert "fix" in err, err
    assert not ray.is_initialized(), "Ray was started for a mistake found in the recipe"
    left = set(os.listdir(workdir)) - before
    assert not left & {"runs", "mlflow.db", "mlruns"}, left


def test_the_battery_is_large_enough() -> None:
    assert len(CASES) >= 40
