"""The device pool a recipe declares: nodes x workers per node of one preset, fixed or elastic, and the
Ray resource that names it (see schema.py)."""

import re
from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from osdp_planners.hardware import PRESETS
from osdp_platform.recipe.section import FieldProblem, Section

# Resources Ray defines itself: a pool must be a custom resource, or it would not name a device type.
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory"})
_RESOURCE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


class HardwareSection(Section):
    """The device pool: nodes x workers per node, each one device of the named preset."""

    accelerator: Literal["cpu", "gpu"] = Field(
        default="cpu", description="the workers' device type; the preset must be of the same type"
    )
    nodes: PositiveInt = Field(
        default=1, description="nodes in a fixed pool (an elastic pool sets min_nodes and max_nodes instead)"
    )
    min_nodes: PositiveInt | None = Field(
        default=None,
        description="elastic pool, with max_nodes: the fewest nodes the run trains on; when nodes go, it re-plans "
        "for the nodes left and resumes from its last checkpoint (fewer: it waits wait_for_nodes_s, then stops)",
    )
    max_nodes: PositiveInt | None = Field(
        default=None,
        description="elastic pool, with min_nodes: the most nodes the run trains on; when nodes come, it grows at "
        "its next checkpoint, re-planned for them (needs train.global_batch_size and checkpoint_every)",
    )
    workers_per_node: PositiveInt = Field(default=2, description="Ray Train workers per node, one device each")
    preset: str = Field(
        default="cpu",
        description="what the planner assumes of a device where it cannot measure "
        f"(memory, speed, links): {', '.join(PRESETS)}",
    )
    memory_per_device_gb: float | None = Field(
        default=None, gt=0, description="device memory in GiB, instead of the preset's"
    )
    autoscaling: bool = Field(
        default=False,
        description="the cluster's autoscaler adds nodes on demand: wait for "
        "them instead of stopping when the pool is short (an elastic pool keeps it asked for max_nodes)",
    )
    pool: str = Field(
        default="auto",
        description="Ray custom resource of which every worker and the planner take one unit, so the plan runs on "
        "the devices it was made for: `auto` = the GPU preset's pool (a100-80gb -> A100_80GB), none "
        "on CPU; `any` = no pool resource; or the name your nodes advertise",
    )
    wait_for_nodes_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds the planner actor waits to be placed (for an autoscaler to "
        "start a node of the pool) before the run stops with an error",
    )

    @model_validator(mode="after")
    def _known_preset(self) -> "HardwareSection":
        if self.preset not in PRESETS:
            raise FieldProblem("hardware.preset", self.preset, "is not a preset", f"use one of {', '.join(PRESETS)}")
        kind = PRESETS[self.preset].accelerator
        if kind != self.accelerator:
            same = [name for name, p in PRESETS.items() if p.accelerator == self.accelerator]
            raise FieldProblem(
                "hardware.preset",
                self.preset,
                f"is a {kind} preset but hardware.accelerator is {self.accelerator!r}",
                f"set hardware.accelerator={kind}, or a {self.accelerator} preset: {', '.join(same)}",
            )
        return self

    @model_validator(mode="after")
    def _pool_is_a_custom_resource(self) -> "HardwareSection":
        if self.pool in ("auto", "any"):
            return self
        if self.pool in RAY_BUILTIN_RESOURCES:
            raise FieldProblem(
                "hardware.pool",
                self.pool,
                "is a resource Ray defines for every node, not a device pool",
                "name the custom resource your pool's nodes advertise (e.g. A100_80GB), or use auto / any",
            )
        if not _RESOURCE_NAME.fullmatch(self.pool):
            raise FieldProblem(
                "hardware.pool",
                self.pool,
                "is not a Ray resource name",
                "use letters, digits, '_', '.' or '-', starting with a letter (e.g. A100_80GB), or auto / any",
            )
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> "HardwareSection":
        if (self.min_nodes is None) != (self.max_nodes is None):
            given, missing = ("min_nodes", "max_nodes") if self.max_nodes is None else ("max_nodes", "min_nodes")
            raise FieldProblem(
                f"hardware.{missing}",
                None,
                f"is needed with hardware.{given}: an elastic pool is the range min_nodes..max_nodes",
                f"set hardware.{missing} too, or remove hardware.{given} for a fixed pool of hardware.nodes",
            )
        if self.min_nodes is not None and self.max_nodes is not None:
            if self.min_nodes > self.max_nodes:
                raise FieldProblem(
                    "hardware.min_nodes",
                    self.min_nodes,
                    f"is above hardware.max_nodes = {self.max_nodes}",
                    f"set it to at most {self.max_nodes}",
                )
            if "nodes" in self.model_fields_set and not self.min_nodes <= self.nodes <= self.max_nodes:
                raise FieldProblem(
                    "hardware.nodes",
                    self.nodes,
                    f"is outside the elastic range {self.min_nodes}..{self.max_nodes} (min_nodes..max_nodes); an "
                    "elastic run trains on the nodes that are there",
                    "remove hardware.nodes, or set it within the range",
                )
        return self

    @property
    def elastic(self) -> bool:
        return self.max_nodes is not None

    @property
    def node_counts(self) -> range:
        """The node counts the run may train on: one for a fixed pool, min_nodes..max_nodes for an elastic one."""
        if self.min_nodes is None or self.max_nodes is None:
            return range(self.nodes, self.nodes + 1)
        return range(self.min_nodes, self.max_nodes + 1)

    @property
    def world_size(self) -> int:
        """The workers of the pool; of an elastic pool, at its largest (max_nodes)."""
        return self.node_counts[-1] * self.workers_per_node

    def fixed(self, nodes: int) -> "HardwareSection":
        """This pool fixed at `nodes` nodes: what one plan of an elastic run is made for."""
        return self.model_copy(update={"nodes": nodes, "min_nodes": None, "max_nodes": None})

    @property
    def pool_resource(self) -> str | None:
        """The custom resource every worker asks for: a GPU preset's name, upper-cased, unless named or `any`."""
        if self.pool == "any":
            return None
        if self.pool == "auto":
            return self.preset.upper().replace("-", "_") if self.accelerator == "gpu" else None
        return self.pool

    @property
    def memory_per_device_bytes(self) -> int:
        if self.memory_per_device_gb is not None:
            return int(self.memory_per_device_gb * 1024**3)
        return PRESETS[self.preset].memory_bytes
