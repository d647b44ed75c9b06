"""The memory the planner leaves unplanned: what its model of a rank cannot see.

On a GPU the caching allocator reserves more than tensors occupy, and a CUDA OOM comes when it
cannot reserve more, not when allocated bytes reach the budget. FSDP2 allocates its all-gather and
reduce-scatter buffers on streams of their own, whose freed blocks the compute stream cannot reuse,
and freed blocks leave holes. On one H200 (torch 2.11, expandable segments, llama 1b and 7b as
rank 0 of 8, seq 2048; benchmarks/gpu_fake_rank.py) the reserved peak was 12-23% over the allocated
one (DP 22.6%, ZeRO-2 12-15%, ZeRO-3 21-22%, HSDP 23.3%, a DP/ZeRO-3 mix 22.4%): the planner
predicts the allocated peak and budgets it times (1 + `allocator_overhead`), 25% on GPUs.
The CUDA context and NCCL's buffers live outside torch's counters (`reserve_bytes`), and the
simulation is within a few percent of FSDP2's real peak, not exact (`fraction` of the budget).
The search fills what `usable` leaves; the advice for a budget that fits nothing adds it all back,
so that following the advice yields a plan. One class: what a request asks for is what the plan records.
"""

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from osdp_planners.hardware import GIB

# CPU ranks count tensors as torch's memory tracker does (what the simulation is checked against):
# the margin only covers the simulation's error. GPU ranks also pay the allocator and the context.
DEFAULT_FRACTION = {"cpu": 0.02, "gpu": 0.05}
DEFAULT_RESERVE_BYTES = {"cpu": 0, "gpu": GIB}
DEFAULT_ALLOCATOR_OVERHEAD = {"cpu": 0.0, "gpu": 0.25}


class MemoryMargin(BaseModel):
    """The memory kept unplanned, as a request asks for it and a plan records it (`usable` says what is left)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(default=0.0, ge=0, lt=1, description="of the budget: the model's error grows with it")
    reserve_bytes: int = Field(default=0, ge=0, description="fixed: CUDA context, communication buffers")
    allocator_overhead: float = Field(
        default=0.0, ge=0, description="what the caching allocator reserves over the allocated peak"
    )

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        """Plans written with two margin classes recorded the usable bytes here too: derived, so dropped."""
        return {k: v for k, v in data.items() if k != "usable_bytes"} if isinstance(data, dict) else data

    @classmethod
    def default(
        cls,
        accelerator: str,
        fraction: float | None = None,
        reserve_bytes: int | None = None,
        allocator_overhead: float | None = None,
    ) -> "MemoryMargin":
        """The device kind's defaults, each overridden where the recipe sets it."""
        return cls(
            fraction=DEFAULT_FRACTION[accelerator] if fraction is None else fraction,
            reserve_bytes=DEFAULT_RESERVE_BYTES[accelerator] if reserve_bytes is None else reserve_bytes,
            allocator_overhead=DEFAULT_ALLOCATOR_OVERHEAD[accelerator]
            if allocator_overhead is None
            else allocator_overhead,
        )

    def usable(self, budget: float) -> float:
        """The allocated peak a plan may reach under `budget`: its reserved peak fits what the margin leaves."""
        return (budget * (1 - self.fraction) - self.reserve_bytes) / (1 + self.allocator_overhead)

    def reserved(self, allocated: float) -> float:
        """The allocator's reserved peak predicted for an allocated peak."""
        return allocated * (1 + self.allocator_overhead)

    def budget_for(self, need: float) -> float:
        """The smallest budget under which `need` is usable, rounded up to 1e-4 GiB for advice."""
        total = self.reserved(need) + self.reserve_bytes
        return math.ceil(total / (1 - self.fraction) / GIB * 1e4) / 1e4 * GIB

    def describe(self) -> str:
        reserve = f" + {self.reserve_bytes / GIB:.2f} GiB" if self.reserve_bytes else ""
        allocator = f", the allocator's {self.allocator_overhead:.0%} over allocated" if self.allocator_overhead else ""
        return f"{self.fraction:.0%}{reserve}{allocator}"
