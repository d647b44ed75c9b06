"""The plan contract between planner and workers: a versioned JSON document.

A plan names every sharding unit by module path, with the strategy, shard-group size, operator split
factor and activation checkpoint flag the workers must apply, the batch sizes, and what the planner
predicts for it (null where a planner makes no prediction).
"""

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from osdp_planners.margin import MemoryMargin

PLAN_VERSION = 1


class Strategy(StrEnum):
    DDP = "ddp"  # replicate: full params, grads and optimizer state on every rank
    ZERO2 = "zero2"  # shard; keep params gathered from forward until backward
    ZERO3 = "zero3"  # shard; gather in forward, free, gather again in backward
    HSDP = "hsdp"  # ZeRO-3 inside groups of shard_group_size ranks, replicated across groups


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UnitPlan(_Strict):
    name: str
    modules: list[str] = Field(min_length=1, description="module paths in this unit ('' is the root)")
    strategy: Strategy
    shard_group_size: int = Field(ge=1, description="ranks one parameter is sharded over (1 for ddp)")
    split: int = Field(default=1, ge=1, description="each Linear in the unit is split into this many slices")
    checkpoint: bool = False
    param_count: int = Field(ge=0)
    predicted_memory_bytes: int | None = None
    predicted_time_s: float | None = None


EXTRAPOLATED = "extrapolated"  # in `times_from`: the step's times are a line carried far past what was timed


class Predicted(_Strict):
    peak_memory_bytes: int | None = None  # allocated: what the rank's tensors occupy at its peak
    reserved_memory_bytes: int | None = None  # what the caching allocator holds then (the budget checks this)
    step_time_s: float | None = None
    throughput_samples_per_s: float | None = None
    # where compute times came from: "measured" on the pool's device (saying so if the host was busy, and
    # if EXTRAPOLATED far beyond the micro batches timed), or "preset <name>" (FLOPs over its rate)
    times_from: str | None = None


class Baseline(_Strict):
    fits: bool
    micro_batch_size: int | None = None
    peak_memory_bytes: int | None = None
    step_time_s: float | None = None
    throughput_samples_per_s: float | None = None


class SearchReport(_Strict):
    """How the osdp search found its plan and why this one was chosen: the near-tie rule may return a
    simpler plan than the fastest found, and this says what that cost."""

    mode: str = Field(description="planner.search: auto (certified), knapsack or milp")
    seconds: float = Field(ge=0, description="wall time of the search, profiling excluded")
    throughput_upper_bound: float | None = Field(
        default=None, description="samples/s no plan in the search space can exceed; null: not bounded (knapsack)"
    )
    optimality_gap: float | None = Field(
        default=None, description="proven: 1 - the best plan found's samples/s over the upper bound"
    )
    best: Predicted = Field(description="the fastest plan the search found")
    best_plan: str = Field(description="that plan in a few words")
    chosen_by: str = Field(description="the rule that chose the plan, with its threshold")
    prefer_simpler: bool
    near_tie: float = Field(description="osdp.NEAR_TIE: how much slower a simpler plan may be predicted")
    simplicity_cost: float = Field(ge=0, description="1 - the chosen plan's samples/s over the best found's")


class Plan(_Strict):
    version: int = PLAN_VERSION
    planner: str
    model: str
    structure_hash: str
    world_size: int = Field(ge=1)
    nodes: int = Field(ge=1)
    workers_per_node: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    grad_accum_steps: int = Field(default=1, ge=1)
    seq_len: int = Field(ge=1)
    precision: str = "fp32"
    compile: bool = False  # each unit's forward through torch.compile (train.compile)
    memory_limit_bytes: int | None = None
    memory_margin: MemoryMargin | None = None  # the memory kept unplanned (margin.py)
    units: list[UnitPlan]
    predicted: Predicted = Field(default_factory=Predicted)
    baselines: dict[str, Baseline] = Field(default_factory=dict)
    search: SearchReport | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version} is not supported (this platform reads {PLAN_VERSION})")
        if self.world_size != self.nodes * self.workers_per_node:
            raise ValueError("world_size must equal nodes x workers_per_node")
        for u in self.units:
            if self.world_size % u.shard_group_size:
                raise ValueError(
                    f"unit {u.name}: shard_group_size {u.shard_group_size} does not divide world size {self.world_size}"
                )
            if u.strategy is Strategy.DDP and u.shard_group_size != 1:
                raise ValueError(f"unit {u.name}: ddp replicates, so shard_group_size must be 1")
            if u.strategy in (Strategy.ZERO2, Strategy.ZERO3) and u.shard_group_size != self.world_size:
                raise ValueError(
                    f"unit {u.name}: {u.strategy} shards over all {self.world_size} ranks, "
                    f"so shard_group_size must be {self.world_size}"
                )
        return self

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_file(cls, path: str | Path) -> "Plan":
        return cls.model_validate_json(Path(path).read_text())
