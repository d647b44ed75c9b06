"""What one unit can be: strategy x shard-group size x operator split x activation checkpointing.

One concept, three views: a `Variant` is how a unit's modules run (what the profiler measures
activations under), an `Option` is the planner's choice for a unit (a variant placed by a strategy
over a shard group), and the plan document's `UnitPlan` is an option with the unit's name, modules
and predictions. The plan is assembled from options field by field and read back with `Option.of`.
"""

from dataclasses import asdict, dataclass
from typing import Any

from osdp_planners.plan import Strategy, UnitPlan

SPLITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Variant:
    """How a unit's modules run: Linears split `split` ways, activations checkpointed or not."""

    split: int = 1
    checkpoint: bool = False


@dataclass(frozen=True)
class Option:
    """The planner's view of a UnitPlan: the choices, without the unit's name, modules or predictions."""

    strategy: Strategy
    shard_group_size: int  # ranks a parameter is sharded over (1 for ddp)
    split: int = 1
    checkpoint: bool = False

    @property
    def holds_params(self) -> bool:
        """DP and ZeRO-2 keep gathered parameters from their forward until their backward."""
        return self.strategy in (Strategy.DDP, Strategy.ZERO2)

    @classmethod
    def of(cls, unit: UnitPlan) -> "Option":
        return cls(unit.strategy, unit.shard_group_size, unit.split, unit.checkpoint)

    def unit_fields(self) -> dict[str, Any]:
        """The UnitPlan fields this option sets."""
        return asdict(self)


def runtime_preference(opt: Option) -> tuple[int, int, bool]:
    """How to order options the time model prices the same: the runtime executes plain replication
    fastest (DP, then HSDP over groups of one, which FSDP2 still wraps), then ZeRO-2 (one gather per
    step), ZeRO-3, HSDP over larger groups (ZeRO-3 plus an all-reduce); fewer FSDP2 units (no split)
    and no recomputation before more."""
    order = {Strategy.DDP: 0, Strategy.ZERO2: 2, Strategy.ZERO3: 3}
    rank = order.get(opt.strategy, 1 if opt.shard_group_size == 1 else 4)
    return rank, opt.split, opt.checkpoint


def strategy_choices(world_size: int, workers_per_node: int, nodes: int) -> list[tuple[Strategy, int]]:
    """Every (strategy, group) the topology allows: HSDP groups divide the world and nest in nodes or span them.

    HSDP with groups of 1 is replication that frees the gathered copy after forward (DP without
    FSDP2's second full copy), so it is a choice of its own.
    """
    choices = [(Strategy.DDP, 1), (Strategy.ZERO2, world_size), (Strategy.ZERO3, world_size)]
    for g in range(1, world_size):
        inside = g <= workers_per_node and workers_per_node % g == 0
        across = g > workers_per_node and g % workers_per_node == 0
        if world_size % g == 0 and (inside or across or nodes == 1):
            choices.append((Strategy.HSDP, g))
    return choices


def unit_options(
    world_size: int, workers_per_node: int, nodes: int, splittable: bool, checkpointable: bool
) -> list[Option]:
    splits = SPLITS if splittable else (1,)
    ckpts = (False, True) if checkpointable else (False,)
    return [
        Option(s, g, k, c)
        for s, g in strategy_choices(world_size, workers_per_node, nodes)
        for k in splits
        for c in ckpts
    ]
