"""What a planner is asked: the model's context (pool, limits, batch, precision), independent of recipes."""

import warnings
from dataclasses import dataclass, field

from osdp_planners.hardware import GIB, DevicePreset
from osdp_planners.margin import MemoryMargin

SEARCHES = ("auto", "knapsack", "milp")  # how osdp searches (batch_search.py)
RENAMED = {"dp": "knapsack"}  # accepted for one release: DP means data parallel everywhere else


def search_mode(mode: str) -> str:
    """The search a request names, the old name `dp` with a warning."""
    if mode in RENAMED:
        warnings.warn(
            f"planner.search={mode} is renamed {RENAMED[mode]} (DP means data parallel elsewhere); "
            f"the old name will be refused in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return RENAMED[mode]
    if mode not in SEARCHES:
        raise ValueError(f"unknown search {mode!r}: use one of {', '.join(SEARCHES)}")
    return mode


@dataclass(frozen=True)
class PlanRequest:
    planner: str  # ddp | zero2 | zero3 | hsdp | osdp | manual
    model_label: str
    nodes: int
    workers_per_node: int
    device: DevicePreset
    memory_limit_bytes: int  # the budget; plans fill it less the margin
    seq_len: int
    micro_batch_size: int | None  # None: the planner chooses
    global_batch_size: int | None  # fixed global batch: the planner picks micro batch x accumulation
    precision: str = "fp32"
    optimizer: str = "adamw"
    compile: bool = False  # train.compile: units run through torch.compile (the probe times them so)
    hsdp_group_size: int | None = None
    plan_file: str | None = None
    token_range: int = 256  # token ids the data produces (bytes), used to drive profiling runs
    margin: MemoryMargin = field(default_factory=MemoryMargin)
    search: str = "auto"  # auto | knapsack | milp (dp: knapsack's old name): how osdp searches (batch_search.py)
    prefer_simpler: bool = True  # the near-tie rule (osdp.prefer_simpler); False: the fastest plan found
    model_key: str | None = None  # the model's whole configuration: set, its profile is reused in-process
    budget_key: str = "planner.memory_limit_gb"  # the recipe key the budget came from, for messages

    @property
    def usable_memory_bytes(self) -> float:
        return self.margin.usable(self.memory_limit_bytes)

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def budget_by_preset(self) -> bool:
        """Whether the budget is the preset's memory: a preset names a device, so it is not raised or
        lowered by a number, and messages name it and point to hardware.memory_per_device_gb."""
        return self.budget_key == "hardware.preset"

    @property
    def budget_value(self) -> object:
        """The budget as the user wrote it: the preset's name, or the GiB of the key they set."""
        return self.device.name if self.budget_by_preset else round(self.memory_limit_bytes / GIB, 4)

    def default_hsdp_group(self) -> int:
        """Shard inside a node (fast links) and replicate across nodes; on one node, over half of it."""
        if self.hsdp_group_size is not None:
            return self.hsdp_group_size
        if self.nodes > 1:
            return self.workers_per_node
        return max(1, self.workers_per_node // 2)
