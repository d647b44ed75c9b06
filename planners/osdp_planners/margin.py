"""The memory the planner leaves unplanned: what its model of a rank cannot see.

On a GPU the caching allocator reserves more than tensors occupy (fragmentation), and the CUDA
context, NCCL's buffers and the framework's own state live outside torch's counters; on any
device the simulation itself is within a few percent of FSDP2's real peak, not exact. A plan is
searched against the budget minus this margin, and the advice for a budget that fits nothing adds
it back, so that following the advice yields a plan.
"""

import math
from dataclasses import dataclass

from osdp_planners.hardware import GIB

# CPU ranks count tensors as torch's memory tracker does (what the simulation is checked against):
# the margin only covers the simulation's error. GPU ranks also pay the allocator and the context.
DEFAULT_FRACTION = {"cpu": 0.02, "gpu": 0.05}
DEFAULT_RESERVE_BYTES = {"cpu": 0, "gpu": GIB}


@dataclass(frozen=True)
class MemoryMargin:
    fraction: float = 0.0  # of the budget: allocator fragmentation and the model's error grow with it
    reserve_bytes: int = 0  # fixed: CUDA context, communication buffers

    @classmethod
    def default(
        cls, accelerator: str, fraction: float | None = None, reserve_bytes: int | None = None
    ) -> "MemoryMargin":
        """The device kind's defaults, each overridden where the recipe sets it."""
        return cls(
            DEFAULT_FRACTION[accelerator] if fraction is None else fraction,
            DEFAULT_RESERVE_BYTES[accelerator] if reserve_bytes is None else reserve_bytes,
        )

    def usable(self, budget: float) -> float:
        """What a plan may occupy under `budget`."""
        return budget * (1 - self.fraction) - self.reserve_bytes

    def budget_for(self, need: float) -> float:
        """The smallest budget under which `need` is usable, rounded up to 1e-4 GiB for advice."""
        return math.ceil((need + self.reserve_bytes) / (1 - self.fraction) / GIB * 1e4) / 1e4 * GIB

    def describe(self) -> str:
        reserve = f" + {self.reserve_bytes / GIB:.2f} GiB" if self.reserve_bytes else ""
        return f"{self.fraction:.0%}{reserve}"
