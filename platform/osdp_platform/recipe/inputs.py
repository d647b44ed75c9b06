"""What a run is fed, as the recipe declares it: the model, the data and the device pool (see schema.py)."""

import re
from pathlib import Path
from typing import Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from osdp_planners.hardware import PRESETS
from osdp_platform.recipe.typetext import takes_number, type_text


class FieldProblem(ValueError):
    """A validator's finding about one key, with its fix: the loader reports it as that key's error,
    not as the whole section's (pydantic names the section a model validator belongs to)."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field, self.value, self.problem, self.fix = field, value, problem, fix


class Section(BaseModel):
    """A recipe section: unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """pydantic takes true as the int 1: `steps: true` would train one step instead of being refused."""
        field = cls.model_fields[str(info.field_name)]
        if isinstance(value, bool) and takes_number(field.annotation):
            raise PydanticCustomError(
                "number_type",
                "Input should be {expected}, not true or false",
                {"expected": type_text(field.annotation, field.metadata).replace("`", "")},
            )
        return value


class ModelSection(Section):
    """One model source: a zoo entry (family + size), a Hugging Face config, or the user's own factory."""

    family: str | None = Field(default=None, description="zoo family, with `size`: llama, gpt2 or opt")
    size: str | None = Field(
        default=None,
        description="zoo preset of the family: llama tiny, 1b, 7b, 13b, 70b; gpt2 tiny, 124m, 355m, "
        "774m, 1.5b, osdp-48l; opt tiny, 125m, 350m, 1.3b, 2.7b, 6.7b, 13b, 30b",
    )
    hf_config: dict[str, Any] | str | None = Field(
        default=None,
        description="a `transformers` config: inline (`model_type: llama` plus that model's fields) or "
        "the path of a local config.json or its folder; built by AutoModelForCausalLM "
        "from the config alone (nothing is downloaded)",
    )
    target: str | None = Field(
        default=None,
        description='"pkg.module:factory" returning your own nn.Module, whose forward(tokens) returns '
        "logits, a tuple starting with them, or an object with .logits (a Hugging Face "
        "ModelOutput); see Your own model",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="overrides of the zoo preset's fields (e.g. n_layers, vocab_size) or of "
        "the hf_config's, or the factory's keyword arguments",
    )

    @field_validator("hf_config")
    @classmethod
    def _absolute(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        """A local config path is named absolutely: Ray workers do not run in the driver's folder."""
        return str(Path(value).resolve()) if isinstance(value, str) and Path(value).exists() else value

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        zoo = self.family is not None or self.size is not None
        sources = [
            name
            for name, given in (
                ("family+size", zoo),
                ("hf_config", self.hf_config is not None),
                ("target", self.target is not None),
            )
            if given
        ]
        if len(sources) > 1:
            raise FieldProblem(
                "model", " + ".join(sources), "gives more than one model source", "keep one of them, remove the others"
            )
        if not sources:
            raise FieldProblem(
                "model",
                None,
                "names no model",
                "give family+size (e.g. family: llama, size: tiny), hf_config (a transformers config) "
                "or target: 'pkg.module:factory'",
            )
        if zoo and (self.family is None or self.size is None):
            missing = "model.size" if self.size is None else "model.family"
            raise FieldProblem(missing, None, "is missing: a zoo model needs both family and size", f"set {missing}")
        if self.target is not None and ":" not in self.target:
            raise FieldProblem("model.target", self.target, "has no ':'", "write it as 'package.module:factory'")
        if isinstance(self.hf_config, dict) and not self.hf_config.get("model_type"):
            raise FieldProblem(
                "model.hf_config.model_type",
                None,
                "is missing from the inline config",
                "add model_type: llama (or gpt2, ...)",
            )
        if isinstance(self.hf_config, str) and not Path(self.hf_config).exists():
            raise FieldProblem(
                "model.hf_config", self.hf_config, "does not exist", "give a local config.json or the folder holding it"
            )
        return self

    @model_validator(mode="after")
    def _zoo_options(self) -> "ModelSection":
        """A zoo preset's overrides are ZooConfig's fields, of its types: the model's constructor would fail on
        n_layers=abc with Python's own words (`'<=' not supported between 'str' and 'int'`)."""
        if self.family is None or not self.kwargs:
            return self
        from osdp_platform.zoo import ZooConfig  # loads torch: only for a zoo model with overrides

        types = {name: hint for name, hint in get_type_hints(ZooConfig).items() if name not in ("family", "size")}
        options = ", ".join(f"{name}: {type_text(hint)}" for name, hint in types.items())
        for name, value in self.kwargs.items():
            if name not in types:
                raise FieldProblem(
                    f"model.kwargs.{name}", value, "is not an option of the zoo models", f"use one of {options}"
                )
            try:  # strict: true is not 1, and 2.5 or "2" is not an int
                TypeAdapter(types[name], config=ConfigDict(strict=True)).validate_python(value)
            except ValidationError:
                expected = type_text(types[name])
                raise FieldProblem(
                    f"model.kwargs.{name}",
                    value,
                    f"Input should be {expected}",
                    f"give {name} as {expected}; the zoo's options: {options}",
                ) from None
        return self

    @property
    def label(self) -> str:
        if self.target:
            return self.target
        if self.hf_config is not None:
            kind = self.hf_config.get("model_type") if isinstance(self.hf_config, dict) else self.hf_config
            return f"hf-{kind}"
        return f"{self.family}-{self.size}"


class DataSection(Section):
    """Token source and tokenizer: synthetic tokens, the bundled corpus, a text file, or prepared token files."""

    source: Literal["synthetic", "corpus", "text_file", "token_files"] = Field(
        default="corpus",
        description="synthetic (generated, learnable byte ids), corpus (bundled public-domain "
        "text, platform/osdp_platform/data/), text_file (`path`), or token_files (`path`: a folder "
        "written by `osdp-platform prepare`, uint16/uint32 files read through "
        "np.memmap, several files as one data set)",
    )
    path: str | None = Field(default=None, description="the text file (text_file) or the folder (token_files)")
    tokenizer: str | None = Field(
        default=None,
        description="bytes (the default, vocab 256), bpe (shipped byte-level BPE trained on the "
        "corpus, vocab 1024) or the path of a `tokenizers` JSON file; token files carry "
        "their own. A zoo or hf_config model whose vocab_size is below the tokenizer's is "
        "refused when the recipe loads",
    )
    seq_len: int = Field(default=64, ge=2, description="tokens per sample: the context length trained on")

    @field_validator("path", "tokenizer")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """Existing local files are named absolutely: Ray workers do not run in the driver's folder."""
        if value is None or value in ("bytes", "bpe") or not Path(value).exists():
            return value
        return str(Path(value).resolve())

    @model_validator(mode="after")
    def _source_inputs(self) -> "DataSection":
        if self.source in ("text_file", "token_files") and not self.path:
            what = "the text file to train on" if self.source == "text_file" else "a folder written by `prepare`"
            raise FieldProblem("data.path", None, f"is missing: source {self.source} needs {what}", "set data.path")
        if self.source == "text_file":
            path = Path(str(self.path))
            if not path.is_file():
                what = "is a folder, not a text file" if path.is_dir() else "does not exist"
                raise FieldProblem("data.path", self.path, what, "name an existing text file")
        elif self.source == "token_files":
            if not Path(str(self.path), "tokens.json").is_file():
                raise FieldProblem(
                    "data.path",
                    self.path,
                    "holds no tokens.json" if Path(str(self.path)).is_dir() else "is not a folder",
                    "write token files with `osdp-platform prepare --tokenizer ... --out DIR FILES...`",
                )
            if self.tokenizer is not None:
                raise FieldProblem(
                    "data.tokenizer",
                    self.tokenizer,
                    "is not used: token files carry the tokenizer that made them (tokens.json)",
                    "remove data.tokenizer",
                )
        elif self.path is not None:
            raise FieldProblem(
                "data.path",
                self.path,
                f"is only read with source text_file or token_files (source is {self.source!r})",
                "remove data.path, or set data.source=text_file",
            )
        if self.source == "synthetic" and self.tokenizer not in (None, "bytes"):
            raise FieldProblem(
                "data.tokenizer", self.tokenizer, "is not used: synthetic data is byte ids", "remove data.tokenizer"
            )
        return self


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
