"""Tokenizers, prepared token files and the step-keyed sampler; the BPE recipe trains through `submit`.

Expected token ids come from the `tokenizers` library called directly, not through the platform.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from helpers import RECIPES
from osdp_planners.errors import UserErrors
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.driver.submit import submit
from osdp_platform.planning.local import plan_request
from osdp_platform.recipe.loader import load_recipe
from osdp_platform.runtime.data import CORPUS_PATH, BatchSampler, Tokens, load_tokens
from osdp_platform.runtime.tokenizer import BPE_PATH, SHIPPED_BPE_VOCAB

SEQ_LEN = 16


def test_shipped_bpe_is_small_lossless_and_compresses_the_corpus() -> None:
    bpe = HFTokenizer.from_file(str(BPE_PATH))
    text = CORPUS_PATH.read_text()
    ids = bpe.encode(text).ids
    assert bpe.get_vocab_size() == SHIPPED_BPE_VOCAB and BPE_PATH.stat().st_size < 64 * 1024
    assert bpe.decode(ids) == text
    assert len(ids) < 0.5 * len(text.encode())


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    """Two text files tokenized by the shipped BPE through the CLI."""
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    text = CORPUS_PATH.read_text()
    first.write_text(text[: len(text) // 2])
    second.write_text("Ünïcode survives byte-level BPE. " * 40)
    assert main(["prepare", "--tokenizer", "bpe", "--out", str(tmp_path / "tok"), str(first), str(second)]) == 0
    return tmp_path / "tok"


def test_prepare_writes_the_tokenizers_ids_and_a_manifest(prepared: Path) -> None:
    manifest = json.loads((prepared / "tokens.json").read_text())
    assert (manifest["tokenizer"], manifest["vocab_size"], manifest["dtype"]) == ("bpe", 1024, "uint16")
    bpe = HFTokenizer.from_file(str(BPE_PATH))
    for entry in manifest["files"]:
        expected = bpe.encode(Path(entry["source"]).read_text()).ids
        stored = np.fromfile(prepared / entry["name"], dtype=np.uint16)
        assert stored.tolist() == expected and entry["tokens"] == len(expected)


def test_token_files_are_memory_mapped_and_windows_stay_inside_one_file(prepared: Path) -> None:
    recipe = load_recipe(
        RECIPES / "tiny.yaml", ["data.source=token_files", f"data.path={prepared}", "model.kwargs.vocab_size=1024"]
    )
    tokens = load_tokens(recipe.data, 0)
    assert len(tokens.parts) == 2 and all(isinstance(p, np.memmap) for p in tokens.parts)
    sampler = BatchSampler(tokens, SEQ_LEN, 0)
    files = [np.asarray(p, dtype=np.int64) for p in tokens.parts]
    seen = set()
    for step in range(20):
        x, y = sampler.global_batch(step, 8)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            part = next(i for i, f in enumerate(files) if _contains(f, row))
            seen.add(part)
    assert seen == {0, 1}


def _contains(haystack: np.ndarray, row: np.ndarray) -> bool:
    starts = np.flatnonzero(haystack[: len(haystack) - len(row) + 1] == row[0])
    return any(np.array_equal(haystack[s : s + len(row)], row) for s in starts)


def test_sampler_is_keyed_by_step_and_workers_split_the_global_batch() -> None:
    parts = [np.arange(1000, dtype=np.uint16), np.arange(5000, 5400, dtype=np.uint32)]
    sampler = BatchSampler(Tokens(parts), SEQ_LEN, seed=4)
    again = BatchSampler(Tokens(parts), SEQ_LEN, seed=4)  # a resumed run starts a fresh sampler
    for step in (0, 7):
        x, y = sampler.global_batch(step, 8)
        assert torch.equal(x, again.global_batch(step, 8)[0])
        rows = [sampler.rank_batch(step, 0, 2, 1, rank, 4) for rank in range(4)]
        assert torch.equal(torch.cat([r[0] for r in rows]), x) and torch.equal(torch.cat([r[1] for r in rows]), y)
        assert ((x[:, 1:] - x[:, :-1]) == 1).all()  # consecutive ids: no window spans both parts
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(Tokens([np.arange(10)]), SEQ_LEN, 0)


def test_text_file_uses_the_chosen_tokenizer(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    recipe = load_recipe(
        RECIPES / "tiny.yaml",
        ["data.source=text_file", f"data.path={text}", "data.tokenizer=bpe", "model.kwargs.vocab_size=1024"],
    )
    assert (
        load_tokens(recipe.data, 0).parts[0].tolist()
        == HFTokenizer.from_file(str(BPE_PATH)).encode(text.read_text()).ids
    )


def test_the_planner_profiles_on_the_tokenizers_ids(prepared: Path) -> None:
    # token_range drives the planner's profiling runs: every id the data holds, not only bytes
    bpe = HFTokenizer.from_file(str(BPE_PATH)).get_vocab_size()
    for overrides, expected in (
        (["data.tokenizer=bpe", "model.kwargs.vocab_size=1024"], bpe),
        (["data.source=token_files", f"data.path={prepared}", "model.kwargs.vocab_size=1024"], bpe),
        ([], 256),
    ):
        assert plan_request(load_recipe(RECIPES / "tiny.yaml", overrides)).token_range == expected, overrides


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["validate", str(RECIPES / "tiny.yaml"), "data.tokenizer=bpe"],
            ["model.kwargs.vocab_size = 256", "1024 token ids", "model.kwargs.vocab_size=1024"],
        ),
        (
            [
                "validate",
                str(RECIPES / "tiny.yaml"),
                "model.family=null",
                "model.size=null",
                "model.kwargs={}",
                "model.hf_config={model_type: llama, vocab_size: 200, hidden_size: 32}",
            ],
            ["model.hf_config.vocab_size = 200", "256 token ids"],
        ),
        (["validate", str(RECIPES / "tiny.yaml"), "data.tokenizer=missing.json"], ["data.tokenizer = 'missing.json'"]),
        (["prepare", "--out", "x", "no-such-file.txt"], ["no-such-file.txt", "does not exist"]),
    ],
)
def test_mistakes_exit_2_with_field_value_and_fix(
    args: list[str],
    words: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(args) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert all(w in err for w in words) and "fix:" in err and "Traceback" not in err


def test_prepare_never_overwrites(prepared: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (prepared / "tokens.json").read_text()
    assert main(["prepare", "--out", str(prepared), str(CORPUS_PATH)]) == EXIT_USER_ERROR
    assert "already holds prepared tokens" in capsys.readouterr().err
    assert (prepared / "tokens.json").read_text() == before


def test_token_files_refuse_a_second_tokenizer(prepared: Path) -> None:
    with pytest.raises(UserErrors, match="carry the tokenizer"):
        load_recipe(
            RECIPES / "tiny.yaml",
            ["data.source=token_files", f"data.path={prepared}", "data.tokenizer=bpe", "model.kwargs.vocab_size=1024"],
        )


def test_tiny_recipe_with_bpe_token_files_trains(ray_cluster: None, workdir: Path, prepared: Path) -> None:
    recipe = load_recipe(
        RECIPES / "tiny-bpe.yaml",
        [
            "train.steps=8",
            "data.source=token_files",
            f"data.path={prepared}",
            "data.tokenizer=null",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
        ],
    )
    losses = [s["loss"] for s in submit(recipe).steps]
    assert len(losses) == 8 and losses[0] > 6.0  # starts near log(1024) = 6.93: the BPE vocabulary
    assert losses[-1] < losses[0] - 0.5
