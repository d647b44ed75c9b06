"""Tokenizers: bytes (vocab 256, nothing to load) or a Hugging Face `tokenizers` JSON file.

`data.tokenizer` names one: `bytes`, `bpe` (a byte-level BPE trained on the bundled corpus and
shipped with the package, so nothing is downloaded), or the path of any `tokenizers` JSON file. The
tokenizer fixes the vocabulary, so a model whose embedding is smaller than it is refused when the
recipe is loaded (`check_model_vocab`), before anything starts.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from osdp_planners.errors import UserError

BYTES = "bytes"
SHIPPED_BPE = "bpe"
BPE_PATH = Path(__file__).parents[1] / "data" / "bpe.json"
BYTE_VOCAB_SIZE = 256
SHIPPED_BPE_VOCAB = 1024


class Tokenizer(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: bytes) -> np.ndarray: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """Every byte is a token: any file, any encoding."""

    name: str = BYTES
    vocab_size: int = BYTE_VOCAB_SIZE

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.uint32)


@dataclass(frozen=True)
class FileTokenizer:
    """A `tokenizers` JSON file (BPE, WordPiece, ...); the text is read as UTF-8."""

    name: str
    path: Path
    vocab_size: int

    def encode(self, text: bytes) -> np.ndarray:
        ids = _load_file(str(self.path)).encode(text.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.uint32)


@cache
def _load_file(path: str) -> Any:
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(path)


def load_tokenizer(name: str | None) -> Tokenizer:
    """`bytes` (also for None), `bpe`, or a tokenizer JSON path; a bad name is a UserError on data.tokenizer."""
    if name is None or name == BYTES:
        return ByteTokenizer()
    path = BPE_PATH if name == SHIPPED_BPE else Path(name)
    if not path.is_file():
        raise UserError(
            "data.tokenizer",
            name,
            "is neither bytes, bpe nor an existing tokenizer JSON file",
            "use bytes, bpe, or the path of a tokenizers JSON file (tokenizer.json)",
        )
    try:
        vocab = _load_file(str(path)).get_vocab_size()
    except Exception as exc:  # the tokenizers library raises its own exception types for unreadable files
        raise UserError(
            "data.tokenizer",
            name,
            f"cannot be read by the tokenizers library ({exc})",
            "give a tokenizer.json saved by tokenizers (Tokenizer.save)",
        ) from None
    return FileTokenizer(name, path, int(vocab))


def train_bpe(files: Iterable[Path], vocab_size: int) -> Any:
    """A byte-level BPE over `files` (every byte sequence encodes; no unknown token). How bpe.json was made."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train([str(f) for f in files], trainer)
    return tokenizer


def _zoo_vocab(model: dict[str, Any]) -> tuple[str, int] | None:
    from osdp_platform.zoo import zoo_config

    try:
        return "model.kwargs.vocab_size", zoo_config(model["family"], model["size"], **model["kwargs"]).vocab_size
    except (ValueError, TypeError):
        return None  # a bad zoo option: the model build reports it


def _hf_vocab(model: dict[str, Any]) -> tuple[str, int] | None:
    config = model["hf_config"]
    try:
        if isinstance(config, str):
            path = Path(config)
            fields = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        else:
            fields = dict(config)
        fields |= model["kwargs"]
        if "vocab_size" not in fields:
            from transformers import AutoConfig

            fields["vocab_size"] = AutoConfig.for_model(fields["model_type"]).vocab_size
        return "model.hf_config.vocab_size", int(fields["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a usable config: the model build reports it


def check_model_vocab(model: dict[str, Any], data_vocab: int, tokenizer: str) -> None:
    """Refuse a zoo or Hugging Face model whose vocabulary is smaller than the data's token ids.

    A `target` model's vocabulary is known only once it is built; it is not checked here.
    """
    if model.get("family") is not None:
        found = _zoo_vocab(model)
    elif model.get("hf_config") is not None:
        found = _hf_vocab(model)
    else:
        return
    if found is not None and found[1] < data_vocab:
        field, vocab = found
        raise UserError(
            field,
            vocab,
            f"the model's vocabulary is smaller than the {data_vocab} token ids of tokenizer {tokenizer!r}",
            f"set {field}={data_vocab} (or more), or use a tokenizer with a smaller vocabulary",
        )
