"""The language-model loss every part of the project computes: training, profiling and timing alike.

A model's forward may return logits, a tuple whose first element is the logits, or an object with
`.logits` (a Hugging Face `ModelOutput`); `logits_of` accepts all three, so a user's model needs no
wrapper. The loss is computed in fp32 whatever the compute dtype, as mixed precision training does.
"""

from typing import Any

import torch
import torch.nn.functional as F


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, `output.logits`, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"the model's forward returned {type(output).__name__}; return logits [batch, seq, vocab], "
        "a tuple starting with them, or an object with a .logits tensor"
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position (targets are already shifted by the data)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
