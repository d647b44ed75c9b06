"""A plan as the planner holds it while choosing: each unit's option, the batch, and what the cost model says."""

from dataclasses import dataclass

from osdp_planners.evaluate import Evaluation
from osdp_planners.options import Option
from osdp_planners.plan import SearchReport, Strategy


@dataclass(frozen=True)
class Choice:
    options: dict[str, Option]
    micro_batch_size: int
    grad_accum_steps: int
    evaluation: Evaluation
    report: SearchReport | None = None  # how the osdp search found it, and why it was chosen


def describe(options: dict[str, Option]) -> str:
    """A plan in a few words, for messages: strategies, splits, checkpointing."""
    kinds: dict[str, int] = {}
    for o in options.values():
        name = (
            f"HSDP({o.shard_group_size})"
            if o.strategy is Strategy.HSDP
            else o.strategy.value.upper().replace("ZERO", "ZeRO-")
        )
        kinds[name] = kinds.get(name, 0) + 1
    words = [", ".join(f"{n} x{k}" for n, k in kinds.items())]
    splits = sorted({o.split for o in options.values()} - {1})
    words.append(f"Linears split {'/'.join(map(str, splits))} ways" if splits else "no split")
    ckpt = sum(o.checkpoint for o in options.values())
    words.append(f"{ckpt} unit(s) checkpointed" if ckpt else "no checkpointing")
    return "; ".join(words)
