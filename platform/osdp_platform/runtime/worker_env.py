"""Environment variables the runtime sets for its training workers, before torch loads in them.

- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows segments instead of
  keeping blocks of every size it was once asked for. FSDP2 frees and re-allocates gathered parameters
  of changing sizes every unit; with fixed segments the reserve runs far ahead of what is allocated,
  and the planner budgets allocated memory.
- TORCH_NCCL_AVOID_RECORD_STREAMS=1: NCCL work keeps its tensors alive by holding references until it
  completes instead of `record_stream`, which delays reuse of freed memory to the allocator's next sync.
Both only matter on CUDA and are harmless on CPU. A variable set in the driver's environment (the
shell that runs `osdp-platform submit`) overrides the default and reaches the workers as it is.
"""

from collections.abc import Mapping

WORKER_ENV_DEFAULTS = {
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
}


def worker_env(driver_env: Mapping[str, str]) -> dict[str, str]:
    """The defaults, each replaced by the driver's own value where the user set one."""
    return {name: driver_env.get(name, default) for name, default in WORKER_ENV_DEFAULTS.items()}
