"""Every private torch API this project uses, in one place, with why no public one serves.

Pinned behaviour is checked by the tests (fake-rank memory, the profiler, plan verification); a torch
upgrade that moves one of these breaks here first.
"""

from collections.abc import Iterable

# Fake tensors: shapes and dtypes without memory, so any model size profiles on a laptop. No public API.
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

# Per-module activation checkpointing that composes with fully_shard on the same module (the public
# torch.utils.checkpoint wraps a function, not a module in place); its registry tells a checkpointed module.
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry as composable_registry

# Module enter/exit in forward and backward, and live-memory accounting by category (FSDP2's own
# memory tests use them); no public equivalent.
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.nn import Module

# Intercepting every op (live bytes, FLOPs, which modules read a parameter) and flattening outputs.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "MemTracker",
    "ModTracker",
    "TorchDispatchMode",
    "checkpoint",
    "composable_registry",
    "detect_fake_mode",
    "register_fake_backend",
    "reshards_after_forward",
    "set_recomputing",
    "tree_leaves",
    "tree_map",
]


def reshards_after_forward(module: object) -> bool:
    """Whether a fully_shard module frees its gathered parameters after forward: FSDP2 has a setter
    (set_reshard_after_forward) but no getter, so this reads its parameter group's state."""
    group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
    return group is not None and group.post_forward_mesh_info is not None


def register_fake_backend() -> None:
    """Make the "fake" process-group backend (collectives that move nothing) available: it registers
    itself when its test-support module is imported, and has no public switch."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def set_recomputing(modules: Iterable[Module], on: bool) -> None:
    """Switch `checkpoint` on or off on modules it was applied to: the compute probe times a model with
    recomputation and then hands it back without. The hooks stay; this flag of their state decides."""
    for module in modules:
        checkpoint.state(module).enable_hook = on
