"""What a run is fed, as the recipe declares it: the model and the data (the device pool: pool.py; see schema.py)."""

from pathlib import Path
from typing import Any, Literal, get_type_hints

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from osdp_platform.recipe.section import FieldProblem, Section
from osdp_platform.recipe.typetext import type_text


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
