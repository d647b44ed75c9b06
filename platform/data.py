"""Token data: bytes as tokens (vocab 256), sampled into deterministic global batches.

Every rank derives the same global batch for a step from (seed, step) and takes its own rows, so a
run on N workers sees exactly the data a single process fed the whole global batch would see, and a
resumed run continues the same sequence.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from osdp_platform.recipe import DataSection

VOCAB_SIZE = 256
CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
SYNTHETIC_LENGTH = 1 << 16


def _synthetic_tokens(seed: int) -> torch.Tensor:
    """Interleaved counting sequences with random strides: random-looking but learnable."""
    gen = torch.Generator().manual_seed(seed)
    strides = torch.randint(1, 17, (SYNTHETIC_LENGTH // 64,), generator=gen)
    starts = torch.randint(0, VOCAB_SIZE, (SYNTHETIC_LENGTH // 64,), generator=gen)
    offsets = torch.arange(64)
    return ((starts[:, None] + strides[:, None] * offsets[None, :]) % VOCAB_SIZE).reshape(-1)


def load_tokens(section: DataSection, seed: int) -> torch.Tensor:
    """The whole token stream as int64, one token per byte."""
    if section.source == "synthetic":
        return _synthetic_tokens(seed)
    path = CORPUS_PATH if section.source == "corpus" else Path(section.path or "")
    raw = path.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


@dataclass(frozen=True)
class BatchSampler:
    tokens: torch.Tensor
    seq_len: int
    seed: int

    def __post_init__(self) -> None:
        if self.tokens.numel() < self.seq_len + 2:
            raise ValueError(f"the data has {self.tokens.numel()} tokens, fewer than seq_len + 2 = {self.seq_len + 2}")

    def global_batch(self, step: int, micro_step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for one micro step of the global batch (all ranks' rows)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro_step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (rows,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.tokens[idx]
        return window[:, :-1], window[:, 1:]

    def rank_batch(
        self, step: int, micro_step: int, micro_batch: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.global_batch(step, micro_step, micro_batch * world_size)
        rows = slice(rank * micro_batch, (rank + 1) * micro_batch)
        return x[rows], y[rows]

    def micro_batches(self, step: int, grad_accum_steps: int, micro_batch: int, rank: int, world_size: int,
                      device: torch.device | str = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of one step, on `device` (what `train_step` consumes)."""
        for micro in range(grad_accum_steps):
            x, y = self.rank_batch(step, micro, micro_batch, rank, world_size)
            yield x.to(device), y.to(device)
