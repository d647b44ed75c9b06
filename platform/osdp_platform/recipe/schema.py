"""The recipe schema: what a user may declare, validated strictly (unknown keys are errors)."""

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from osdp_planners.hardware import PRESETS
from osdp_planners.margin import MemoryMargin
from osdp_planners.request import RENAMED, search_mode
from osdp_platform.recipe.inputs import DataSection, ModelSection
from osdp_platform.recipe.pool import HardwareSection
from osdp_platform.recipe.section import FieldProblem, Section


class PlannerSection(Section):
    name: Literal["ddp", "zero2", "zero3", "hsdp", "osdp", "manual"] = Field(
        default="osdp",
        description=(
            "osdp (per unit: strategy, split factor and recomputation, plus the batch size), one strategy for every "
            "unit (ddp, zero2, zero3, hsdp), or manual (evaluate plan_file)"
        ),
    )
    memory_limit_gb: float | None = Field(
        default=None,
        gt=0,
        description=("per-device memory budget the plan must fit, in GiB; default: the device memory"),
    )
    memory_margin: float | None = Field(
        default=None,
        ge=0,
        lt=0.5,
        description=(
            "share of the budget kept unplanned (allocator fragmentation, model error); default 0.02 on CPU, "
            "0.05 on GPU"
        ),
    )
    memory_reserve_gb: float | None = Field(
        default=None,
        ge=0,
        description=("fixed memory kept unplanned (CUDA context, NCCL buffers), in GiB; default 0 on CPU, 1 on GPU"),
    )
    allocator_overhead: float | None = Field(
        default=None,
        ge=0,
        le=4,
        description=(
            "what the CUDA caching allocator reserves over the allocated peak, as a share of it; the plan's "
            "reserved peak must fit the budget; default 0 on CPU, 0.25 on GPU (measured with the workers' "
            "expandable_segments; raise it if you turn that off)"
        ),
    )
    hsdp_group_size: PositiveInt | None = Field(
        default=None,
        description=(
            "ranks in each HSDP shard group, a divisor of the world size; default: a node's workers on several "
            "nodes, half a node on one"
        ),
    )
    plan_file: str | None = Field(
        default=None, description=("the plan JSON the manual planner evaluates (e.g. from `osdp-platform plan --out`)")
    )
    search: Literal["auto", "knapsack", "milp"] = Field(
        default="auto",
        description=(
            "how osdp searches: auto (certified: prints the optimality gap it proves, within 0.5% or exact), "
            "knapsack (over a memory bound, milliseconds, leaves memory unused; `dp` is its old name), milp "
            "(exact over the simulated peak, may take minutes); see The planner"
        ),
    )
    prefer_simpler: bool = Field(
        default=True,
        description=(
            "return the simplest plan for the runtime predicted within 10% of the fastest (osdp.NEAR_TIE); "
            "false: the fastest. The plan records both"
        ),
    )

    @field_validator("search", mode="before")
    @classmethod
    def _renamed_search(cls, value: object) -> object:
        return search_mode(value) if isinstance(value, str) and value in RENAMED else value

    @model_validator(mode="after")
    def _manual_needs_file(self) -> "PlannerSection":
        if self.name == "manual":
            if not self.plan_file:
                raise FieldProblem(
                    "planner.plan_file",
                    None,
                    "is missing: the manual planner evaluates a plan file",
                    "set planner.plan_file to a plan JSON (from `osdp-platform plan RECIPE --out plan.json`)",
                )
            if not Path(self.plan_file).is_file():
                raise FieldProblem("planner.plan_file", self.plan_file, "does not exist", "name an existing plan JSON")
        return self


class TrainSection(Section):
    steps: PositiveInt = Field(default=20, description="optimizer steps")
    micro_batch_size: PositiveInt | Literal["auto"] = Field(
        default=4, description=("samples per worker in one forward and backward; auto: the planner chooses")
    )
    global_batch_size: PositiveInt | None = Field(
        default=None,
        description=(
            "samples per optimizer step over all workers, a multiple of micro_batch_size x world size (the ratio is "
            "the gradient accumulation); default: micro_batch_size x world size"
        ),
    )
    optimizer: Literal["adamw", "sgd"] = Field(default="adamw", description="torch.optim.AdamW or SGD")
    lr: float = Field(default=1e-3, gt=0, description="learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="the optimizer's weight_decay")
    seed: int = Field(default=0, description="seeds the initial weights and the data order")
    precision: Literal["fp32", "bf16-mixed"] = Field(
        default="fp32",
        description=("bf16-mixed: bf16 compute and gathers, fp32 sharded weights and gradient reduction"),
    )
    compile: bool = Field(
        default=False,
        description=(
            "run each unit's forward through torch.compile (per block, composed with FSDP2 as torchtitan "
            "applies it); the planner's probe times the compiled units; the first step pays the compilation"
        ),
    )
    checkpoint_every: int = Field(default=0, ge=0, description="steps between checkpoints; 0 = never")
    checkpoint_dir: str | None = Field(
        default=None,
        description="where checkpoints are stored, reachable from every worker: a path (shared "
        "on a cluster) or a URI Ray Train storage supports (s3://, gs://, ...); "
        "default: runs/ beside the driver",
    )
    checkpoints_to_keep: PositiveInt | None = Field(default=None, description="keep only the newest N; default: all")
    max_failures: int = Field(
        default=1, ge=-1, description="worker-failure restarts from the last checkpoint; -1 = unlimited"
    )

    @property
    def storage_root(self) -> str:
        """Ray Train's storage_path: the URI as given, a local path made absolute (workers run elsewhere)."""
        if self.checkpoint_dir and "://" in self.checkpoint_dir:
            return self.checkpoint_dir.rstrip("/")
        return str(Path(self.checkpoint_dir or "runs").expanduser().resolve())


class TrackingSection(Section):
    uri: str | None = Field(
        default=None,
        description=(
            "MLflow tracking store: a server (http://...) or a database (sqlite:///...); default "
            "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db"
        ),
    )
    experiment: str = Field(default="osdp-platform", description="MLflow experiment the runs are recorded in")
    wait_for_server_s: float = Field(
        default=300.0,
        ge=0,
        description=(
            "seconds the end of a run waits for a tracking server that went away before leaving its writes on disk "
            "(`osdp-platform sync` uploads them later)"
        ),
    )

    @property
    def resolved_uri(self) -> str:
        return self.uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


class Recipe(Section):
    name: str = Field(
        default="run",
        description=("the MLflow run's name; Ray Train's run folder (holding the checkpoints) is `<name>-<run id>`"),
    )
    model: ModelSection = Field(
        description=(
            "what to train, from one source: a zoo preset (family + size), a Hugging Face config (hf_config) or your "
            "own factory (target)"
        )
    )
    data: DataSection = Field(default_factory=DataSection, description="the tokens trained on and their tokenizer")
    hardware: HardwareSection = Field(
        default_factory=HardwareSection,
        description=("the device pool: nodes x workers_per_node workers, one device each"),
    )
    planner: PlannerSection = Field(
        default_factory=PlannerSection,
        description=("how the model is sharded: the planner, its search and the memory budget the plan must fit"),
    )
    train: TrainSection = Field(
        default_factory=TrainSection,
        description=("the training loop: steps, batch, optimizer, precision, checkpoints and restarts"),
    )
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="where MLflow records runs")

    @model_validator(mode="after")
    def _batch_consistent(self) -> "Recipe":
        sizes = [n * self.hardware.workers_per_node for n in self.hardware.node_counts]
        which = "every world size of the elastic pool" if self.hardware.elastic else "the world size"
        g = self.planner.hsdp_group_size
        for ws in sizes:
            if g is not None and ws % g:
                raise FieldProblem(
                    "planner.hsdp_group_size",
                    g,
                    f"does not divide {which}, {ws} (hardware nodes x workers_per_node)",
                    f"use a divisor of {ws}: {', '.join(str(d) for d in range(1, ws + 1) if ws % d == 0)}",
                )
        gb, mb = self.train.global_batch_size, self.train.micro_batch_size
        if self.hardware.elastic:
            self._elastic_training()
        if gb is not None:
            step = math.lcm(*sizes) * (1 if mb == "auto" else mb)
            if gb % step:
                what = which if mb == "auto" else f"micro_batch_size x {which}"
                raise FieldProblem(
                    "train.global_batch_size",
                    gb,
                    f"is not a multiple of {what} = {step}",
                    f"use a multiple of {step}, e.g. {max(step, gb // step * step)}",
                )
        margin = self.memory_margin
        if margin.usable(self.memory_limit_bytes) <= 0:
            budget = f"{self.memory_limit_bytes / 1024**3:.4g} GiB"
            reserve = f"{margin.reserve_bytes / 1024**3:.4g} GiB"
            if self.planner.memory_reserve_gb is None:
                raise FieldProblem(
                    self.budget_key,
                    round(self.memory_limit_bytes / 1024**3, 4),
                    f"is below the {reserve} a {self.hardware.accelerator.upper()} keeps unplanned by default "
                    "(planner.memory_reserve_gb: the CUDA context, NCCL buffers)",
                    f"raise it above {reserve}, or set planner.memory_reserve_gb lower",
                )
            raise FieldProblem(
                "planner.memory_reserve_gb",
                self.planner.memory_reserve_gb,
                f"leaves nothing of the {budget} budget ({self.budget_key}) to plan",
                f"lower it (or set it to 0), or raise {self.budget_key}",
            )
        return self

    @model_validator(mode="after")
    def _budget_within_the_device(self) -> "Recipe":
        """planner.memory_limit_gb is a per-device budget: above the device's memory, the planner would make
        plans no device holds."""
        limit = self.planner.memory_limit_gb
        if limit is None or self.memory_limit_bytes <= self.hardware.memory_per_device_bytes:
            return self
        device = f"{self.hardware.memory_per_device_bytes / 1024**3:.4g} GiB"
        if self.hardware.memory_per_device_gb is not None:
            key, value = "hardware.memory_per_device_gb", f"{self.hardware.memory_per_device_gb:g}"
        else:
            key, value = "hardware.preset", f"{self.hardware.preset} ({device})"
        raise FieldProblem(
            "planner.memory_limit_gb",
            limit,
            f"is above the memory of one device, {key} = {value}: it is a per-device budget",
            f"set planner.memory_limit_gb to at most {device}, or hardware.memory_per_device_gb to what a device holds",
        )

    def _elastic_training(self) -> None:
        """What an elastic pool needs of training: a global batch that stays (the loss curve continues when
        the world size changes) and checkpoints (what a resized group resumes from)."""
        sizes = [n * self.hardware.workers_per_node for n in self.hardware.node_counts]
        mb = self.train.micro_batch_size
        example = math.lcm(*sizes) * (1 if mb == "auto" else mb)
        if self.train.global_batch_size is None:
            raise FieldProblem(
                "train.global_batch_size",
                None,
                "must be set for an elastic pool (hardware.min_nodes..max_nodes): it stays fixed while the world "
                "size changes, and gradient accumulation makes up the difference",
                f"set it to a multiple of micro_batch_size x every world size {sizes}, e.g. {example}",
            )
        if self.planner.name == "manual":
            raise FieldProblem(
                "planner.name",
                "manual",
                "a plan file is made for one world size, and an elastic pool is re-planned for every size it gets",
                "use planner.name=osdp (or a uniform planner), or a fixed pool (remove min_nodes and max_nodes)",
            )
        if self.train.checkpoint_every == 0:
            raise FieldProblem(
                "train.checkpoint_every",
                0,
                "must be above 0 for an elastic pool: a group that shrinks or grows resumes from the last checkpoint",
                "set it, e.g. train.checkpoint_every=10",
            )

    def at_nodes(self, nodes: int) -> "Recipe":
        """This recipe on a fixed pool of `nodes` nodes: what one plan of an elastic run is made for."""
        return self.model_copy(update={"hardware": self.hardware.fixed(nodes)})

    @property
    def memory_margin(self) -> MemoryMargin:
        reserve = self.planner.memory_reserve_gb
        return MemoryMargin.default(
            PRESETS[self.hardware.preset].accelerator,
            self.planner.memory_margin,
            None if reserve is None else int(reserve * 1024**3),
            self.planner.allocator_overhead,
        )

    @property
    def budget_key(self) -> str:
        """The key the memory budget comes from, as the user wrote it (messages name this one)."""
        if self.planner.memory_limit_gb is not None:
            return "planner.memory_limit_gb"
        if self.hardware.memory_per_device_gb is not None:
            return "hardware.memory_per_device_gb"
        return "hardware.preset"

    @property
    def memory_limit_bytes(self) -> int:
        if self.planner.memory_limit_gb is not None:
            return int(self.planner.memory_limit_gb * 1024**3)
        return self.hardware.memory_per_device_bytes
