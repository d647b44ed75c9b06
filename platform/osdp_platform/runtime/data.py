"""Token data, sampled into deterministic global batches.

Sources: synthetic tokens, the bundled corpus or a text file (tokenized when loaded, held as
uint32), or token files written by `osdp-platform prepare` (uint16/uint32, read through
`np.memmap`, so a rank's memory does not grow with the data set and several files act as one).

Every rank derives the same global batch for a step from (seed, step) and takes its own rows, so a
run on N workers sees exactly the data a single process fed the whole global batch would see, and a
resumed run continues the same sequence, under any split of that batch into micro batches, accumulation
steps and workers (an elastic run changes it when its world size changes). A window never crosses from
one file into the next.
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from osdp_planners.errors import UserError
from osdp_platform.recipe.schema import DataSection, Recipe
from osdp_platform.runtime.tokenizer import BYTE_VOCAB_SIZE, check_model_vocab, load_tokenizer

CORPUS_PATH = Path(__file__).parents[1] / "data" / "corpus.txt"
SYNTHETIC_LENGTH = 1 << 16
MANIFEST = "tokens.json"  # what `prepare` writes beside the token files
MANIFEST_FORMAT = 1
TEXT_SNIFF_BYTES = 1 << 16
SCAN_CHUNK = 1 << 24  # token ids checked per read: 64 MiB of uint32 at a time


@dataclass(frozen=True)
class TokenFiles:
    """A `prepare` output folder: its token files, their dtype and the tokenizer that made them."""

    folder: Path
    files: list[str]
    dtype: str
    vocab_size: int
    tokenizer: str

    @classmethod
    def read(cls, folder: str | Path) -> "TokenFiles":
        path = Path(folder) / MANIFEST
        fix = "point data.path at a folder written by `osdp-platform prepare`, or prepare it again"
        if not path.is_file():
            raise UserError("data.path", str(folder), f"has no {MANIFEST}", fix)
        try:
            meta = json.loads(path.read_text())
            names = [str(f["name"]) for f in meta["files"]]
            dtype, vocab, tokenizer = str(meta["dtype"]), int(meta["vocab_size"]), str(meta["tokenizer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(
                "data.path", str(path), f"is not a token-file manifest ({type(exc).__name__}: {exc})", fix
            ) from None
        if meta.get("format") != MANIFEST_FORMAT:
            raise UserError(
                "data.path",
                str(folder),
                f"{MANIFEST} has format {meta.get('format')!r}, this platform reads {MANIFEST_FORMAT}",
                fix,
            )
        if dtype not in ("uint16", "uint32"):
            raise UserError("data.path", str(path), f"names dtype {dtype!r}, not uint16 or uint32", fix)
        missing = [n for n in names if not (Path(folder) / n).is_file()]
        if missing:
            raise UserError(
                "data.path", str(folder), f"token files listed in {MANIFEST} are missing: {missing[:3]}", fix
            )
        return cls(Path(folder), names, dtype, vocab, tokenizer)

    def check(self, seq_len: int) -> None:
        """Every file whole (a multiple of the dtype, not empty), its ids below the vocabulary (a memmap
        scan in chunks), and one file long enough for a sample: what a worker would otherwise find
        deep in a run (a reshape error, an IndexError in the embedding)."""
        size = np.dtype(self.dtype).itemsize
        fix = "prepare the folder again with `osdp-platform prepare`"
        longest = 0
        for name in self.files:
            path = self.folder / name
            nbytes = path.stat().st_size
            if nbytes == 0 or nbytes % size:
                what = "is empty" if nbytes == 0 else f"has {nbytes} bytes, not a multiple of {self.dtype}'s {size}"
                raise UserError("data.path", str(path), f"{what} (a truncated or foreign file)", fix)
            ids = np.memmap(path, dtype=self.dtype, mode="r")
            for start in range(0, len(ids), SCAN_CHUNK):
                top = int(ids[start : start + SCAN_CHUNK].max())
                if top >= self.vocab_size:
                    raise UserError(
                        "data.path",
                        str(path),
                        f"holds token id {top}, beyond the vocabulary of {self.vocab_size} its {MANIFEST} names",
                        fix,
                    )
            longest = max(longest, len(ids))
        if longest < seq_len + 2:
            raise UserError(
                "data.seq_len",
                seq_len,
                f"the longest token file in {self.folder} has {longest} tokens, fewer than seq_len + 2",
                "lower data.seq_len or prepare longer texts",
            )

    @classmethod
    def prepare(cls, texts: Sequence[Path], tokenizer_name: str, out: Path) -> "TokenFiles":
        """Tokenize each text file into `out` (one token file each, in order) and write the manifest last.

        A file is tokenized whole, so split a large corpus into several files. An existing manifest in
        `out` is never overwritten.
        """
        tokenizer = load_tokenizer(tokenizer_name)
        for text in texts:
            check_text(text, "files")
        if (out / MANIFEST).exists():
            raise UserError(
                "--out",
                str(out),
                f"already holds prepared tokens ({MANIFEST})",
                "choose a new --out folder, or delete that one first",
            )
        out.mkdir(parents=True, exist_ok=True)
        dtype = token_dtype(tokenizer.vocab_size)
        entries: list[dict[str, Any]] = []
        for i, text in enumerate(texts):
            ids = tokenizer.encode(text.read_bytes()).astype(dtype)
            name = f"{i:04d}-{text.stem}.bin"
            ids.tofile(out / name)
            entries.append({"name": name, "tokens": len(ids), "source": str(text)})
        manifest = {
            "format": MANIFEST_FORMAT,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype,
            "files": entries,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
        return cls(out, [e["name"] for e in entries], dtype, tokenizer.vocab_size, tokenizer.name)

    def arrays(self) -> list[np.ndarray]:
        return [np.memmap(self.folder / name, dtype=self.dtype, mode="r") for name in self.files]


def check_text(path: Path, field: str) -> None:
    """A text to tokenize must be a non-empty text file: a binary (a NUL byte, or bytes that are not
    UTF-8 in its first 64 KiB) would train on noise without a word."""
    if not path.is_file():
        what = "is a folder, not a text file" if path.is_dir() else "does not exist"
        raise UserError(field, str(path), what, "name an existing text file")
    with path.open("rb") as f:
        head = f.read(TEXT_SNIFF_BYTES)
    if not head:
        raise UserError(field, str(path), "is empty", "name a file with text in it")
    try:
        head.decode("utf-8")
        binary = b"\x00" in head
    except UnicodeDecodeError as exc:
        binary = exc.start < len(head) - 3  # a character cut at the sniff's end is not binary
    if binary:
        raise UserError(field, str(path), "is not a text file (binary content)", "name a UTF-8 text file")


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _synthetic_tokens(seed: int) -> np.ndarray:
    """Interleaved counting sequences with random strides: random-looking but learnable (byte ids)."""
    gen = torch.Generator().manual_seed(seed)
    strides = torch.randint(1, 17, (SYNTHETIC_LENGTH // 64,), generator=gen)
    starts = torch.randint(0, BYTE_VOCAB_SIZE, (SYNTHETIC_LENGTH // 64,), generator=gen)
    offsets = torch.arange(64)
    return ((starts[:, None] + strides[:, None] * offsets[None, :]) % BYTE_VOCAB_SIZE).reshape(-1).numpy()


def data_vocab_size(section: DataSection) -> int:
    """Token ids the data holds are below this: the model's vocabulary must cover it."""
    if section.source == "synthetic":
        return BYTE_VOCAB_SIZE
    if section.source == "token_files":
        return TokenFiles.read(str(section.path)).vocab_size
    return load_tokenizer(section.tokenizer).vocab_size


def check_vocab(recipe: Recipe) -> None:
    """The model must have an embedding row for every token id the data holds (UserError otherwise)."""
    data = recipe.data
    tokenizer = data.tokenizer or (
        TokenFiles.read(str(data.path)).tokenizer if data.source == "token_files" else "bytes"
    )
    check_model_vocab(recipe.model.model_dump(), data_vocab_size(data), tokenizer)


def load_tokens(section: DataSection, seed: int) -> "Tokens":
    if section.source == "synthetic":
        return Tokens([_synthetic_tokens(seed)])
    if section.source == "token_files":
        return Tokens(TokenFiles.read(str(section.path)).arrays())
    path = CORPUS_PATH if section.source == "corpus" else Path(section.path or "")
    return Tokens([load_tokenizer(section.tokenizer).encode(path.read_bytes())])


@dataclass(frozen=True)
class Tokens:
    """One or more token sequences (in memory or memory-mapped) that windows are drawn from."""

    parts: Sequence[np.ndarray]

    def window_counts(self, length: int) -> np.ndarray:
        """Start positions per part for windows of `length` tokens (one spare, as the sampler always had)."""
        return np.array([max(0, len(p) - length) for p in self.parts], dtype=np.int64)

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Rows of `length` tokens at global start indices (counted over every part's valid starts)."""
        bounds = np.cumsum(self.window_counts(length))
        rows = []
        for start in starts.tolist():
            part = int(np.searchsorted(bounds, start, side="right"))
            offset = start - (int(bounds[part - 1]) if part else 0)
            rows.append(torch.from_numpy(np.asarray(self.parts[part][offset : offset + length], dtype=np.int64)))
        return torch.stack(rows)


@dataclass(frozen=True)
class BatchSampler:
    tokens: Tokens
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        if int(self.tokens.window_counts(self.seq_len + 1).sum()) < 1:
            longest = max((len(p) for p in self.tokens.parts), default=0)
            raise ValueError(
                f"the longest token sequence has {longest} tokens, fewer than seq_len + 2 = {self.seq_len + 2}"
            )

    def _starts(self, step: int, rows: int) -> torch.Tensor:
        """Where the step's `rows` windows begin: drawn from (seed, step) alone, whatever the split."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009)
        total = int(self.tokens.window_counts(self.seq_len + 1).sum())
        return torch.randint(0, total, (rows,), generator=gen)

    def _rows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens.windows(starts, self.seq_len + 1)
        return window[:, :-1], window[:, 1:]

    def global_batch(self, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of a step's whole global batch of `rows` samples."""
        return self._rows(self._starts(step, rows))

    def rank_batch(
        self, step: int, micro_step: int, micro_batch: int, grad_accum_steps: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of one micro step: its part (`rows_of`) of the step's global batch."""
        starts = self._starts(step, micro_batch * grad_accum_steps * world_size)
        return self._rows(starts[rows_of(micro_step, rank, micro_batch, world_size)])

    def micro_batches(
        self,
        step: int,
        grad_accum_steps: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of one step, on `device` (what `train_step` consumes)."""
        for micro in range(grad_accum_steps):
            x, y = self.rank_batch(step, micro, micro_batch, grad_accum_steps, rank, world_size)
            yield x.to(device), y.to(device)


def rows_of(micro_step: int, rank: int, micro_batch: int, world_size: int) -> slice:
    """The rows of a step's global batch that `rank` trains on in `micro_step`: micro steps in order, ranks in
    order within each. Every split of the same global batch (micro x accumulation x world) covers each row
    once, so a run that changes its world size mid-way still trains each step on the same samples."""
    first = (micro_step * world_size + rank) * micro_batch
    return slice(first, first + micro_batch)
