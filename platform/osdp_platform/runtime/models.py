"""Build the recipe's model: a zoo entry, a Hugging Face config, or the user's own factory.

Every model is constructed with its parameters on meta (buffers stay real and small), then either
kept there (planning), initialised whole on one device (`build_model`), or sharded by a plan before
any parameter gets memory (`build_sharded`, see meta_init.py). Models with an init protocol (the zoo,
Hugging Face models, a user model with `init_module`) draw their weights module by module from the
RNG state at the call, so a single-process build and any sharded build agree. A model without one
is built whole on CPU by its own constructor on every rank: such a worker briefly holds the full
fp32 model in host memory, which the planner's per-device budget does not count.
"""

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from osdp_planners.errors import UserError
from osdp_planners.plan import Plan
from osdp_planners.torch_private import detect_fake_mode
from osdp_platform.recipe.schema import ModelSection
from osdp_platform.runtime.apply import Meshes, apply_plan
from osdp_platform.runtime.meta_init import init_protocol, initialize, scatter_into
from osdp_platform.zoo import zoo_config, zoo_module, zoo_sizes


def _import_factory(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            "model.target",
            target,
            f"cannot import {module_name!r} ({exc})",
            "make the module importable (installed, or on PYTHONPATH)",
        ) from None
    if not hasattr(module, attr):
        raise UserError(
            "model.target",
            target,
            f"{module_name!r} has no attribute {attr!r}",
            "name a function or class in that module",
        ) from None
    return getattr(module, attr)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to meta as it is registered; buffers keep their device.

    Default initialisers that run after registration (nn.Linear's) then touch meta tensors only: no
    memory and no RNG draws. Buffers (rotary tables, masks) keep the values their constructor computed.
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


_CONFIG_FIELDS: dict[Any, frozenset[str]] = {}  # a transformers config class -> its field names and aliases


def _config_fields(config_class: Any) -> frozenset[str]:
    """A config class's field names and aliases, from a default instance: once per class, since planning
    builds the model on meta many times."""
    if config_class not in _CONFIG_FIELDS:
        _CONFIG_FIELDS[config_class] = frozenset(vars(config_class())) | frozenset(config_class.attribute_map)
    return _CONFIG_FIELDS[config_class]


def _refuse_typos(config: Any, given: dict[str, tuple[str, object]]) -> None:
    """A config field transformers does not know but that is one letter from one it does: transformers
    keeps any name and builds the model without it (num_hiden_layers=1 gave the config's default depth).
    A name close to none is left alone: a config may carry fields of its own."""
    known = _config_fields(type(config))
    public = sorted(k for k in known if not k.startswith("_"))
    for where, (key, value) in given.items():
        if key in known or f"_{key}" in known or key == "model_type":
            continue
        close = difflib.get_close_matches(key, public, n=1, cutoff=0.85)
        if close:
            raise UserError(
                where,
                value,
                f"is not a field of {type(config).__name__}: transformers would build the model without it",
                f"did you mean {close[0]}?",
            )


def _hf_model(section: ModelSection) -> nn.Module:
    """A `transformers` causal LM from a config alone (inline, or a local config.json): nothing is downloaded."""
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError(
            "model.hf_config", section.hf_config, "needs the transformers package", "pip install transformers"
        ) from None
    try:
        if isinstance(section.hf_config, str):
            config = AutoConfig.from_pretrained(section.hf_config, local_files_only=True, **section.kwargs)
        else:
            fields = dict(section.hf_config or {})
            config = AutoConfig.for_model(str(fields.pop("model_type", "")), **fields, **section.kwargs)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise UserError(
            "model.hf_config",
            section.hf_config,
            f"is not a usable transformers config ({' '.join(str(exc).split())[:200]})",
            "give model_type (e.g. llama, gpt2) and that model's config fields, or the path of a local config.json",
        ) from None
    inline = {} if isinstance(section.hf_config, str) else section.hf_config or {}
    _refuse_typos(config, {f"model.hf_config.{k}": (k, v) for k, v in inline.items()})
    _refuse_typos(config, {f"model.kwargs.{k}": (k, v) for k, v in section.kwargs.items()})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # an encoder-decoder (t5) or an encoder-only model
        raise UserError(
            "model.hf_config",
            section.hf_config,
            f"model_type {config.model_type!r} has no causal language model in transformers "
            "(AutoModelForCausalLM has no class for it), and the platform trains next-token prediction",
            "use a decoder-only model_type, such as llama, qwen2, mistral, gemma or gpt2",
        )
    config.use_cache = False  # training never reads a KV cache; without this every forward returns one
    # torch's default dtype, not the config's (a Hub config says bfloat16): fp32 master weights where the
    # runtime builds, the compute dtype where the profiler traces activations under bf16-mixed
    return AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())


def _construct(section: ModelSection) -> nn.Module:
    if section.family is not None:
        sizes = zoo_sizes()
        if section.family not in sizes:
            raise UserError("model.family", section.family, "is not a zoo family", f"use one of {', '.join(sizes)}")
        if section.size not in sizes[section.family]:
            raise UserError(
                "model.size",
                section.size,
                f"is not a size of the {section.family} family",
                f"use one of {', '.join(sizes[section.family])}",
            )
        try:
            return zoo_module(section.family, str(section.size), **section.kwargs)
        except (ValueError, TypeError) as exc:
            preset = dataclasses.asdict(zoo_config(section.family, str(section.size)))
            values = ", ".join(f"{k}={v}" for k, v in preset.items() if k not in ("family", "size"))
            raise UserError(
                "model.kwargs",
                section.kwargs,
                str(exc),
                f"change model.kwargs so that this holds (the {section.family}/{section.size} preset has {values})",
            ) from None
    if section.hf_config is not None:
        return _hf_model(section)
    model = _import_factory(str(section.target))(**section.kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(
            "model.target",
            section.target,
            f"returned {type(model).__name__}, not nn.Module",
            "return a torch.nn.Module from the factory",
        )
    return model


def _skeleton(section: ModelSection) -> nn.Module:
    with _parameters_on_meta():
        return _construct(section)


def _to_empty(model: nn.Module, device: str | torch.device) -> None:
    """Allocate the parameters on `device` (uninitialised), keeping the buffers' values.

    FSDP2 keeps tied parameters tied through `to_empty`; a plain module may not, so `build_model` re-ties.
    """
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def build_model(section: ModelSection, device: str | torch.device = "cpu") -> nn.Module:
    """The whole model on `device`, from the global RNG state (seed first for identical weights on every rank).

    On meta nothing is initialised (planning). Elsewhere a model with an init protocol is initialised
    module by module exactly as `build_sharded` does; one without is built by its own constructor on
    CPU and moved, as `build_sharded` builds it at every world size (a GPU's generator draws otherwise).
    """
    if detect_fake_mode() is not None:  # profiling on fake tensors: no values to draw
        with torch.device(device):
            return _construct(section)
    rng = torch.get_rng_state()
    model = _skeleton(section)
    if torch.device(device).type == "meta":
        return model
    protocol = init_protocol(model)
    if protocol is None:
        torch.set_rng_state(rng)
        return _construct(section).to(device)
    _to_empty(model, device)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    torch.set_rng_state(rng)
    initialize(model, protocol)
    return model


def build_sharded(section: ModelSection, plan: Plan, device: torch.device, meshes: Meshes | None = None) -> nn.Module:
    """The model with `plan` applied, each rank allocating only its shards plus one unit in full at a time.

    Same weights as `build_model(section, device)` from the same RNG state. Needs the process group `plan` is for.
    """
    if plan.world_size == 1:  # nothing to shard: the whole model, as build_model makes it (see apply.py)
        model = build_model(section, device)
        apply_plan(model, plan, device.type, meshes)
        return model
    rng = torch.get_rng_state()
    reference = _skeleton(section)  # stays unsplit and unsharded: the initialiser runs on it
    protocol = init_protocol(reference)
    if protocol is None:
        torch.set_rng_state(rng)
        model = build_model(section, "cpu")
        apply_plan(model, plan, device.type, meshes)
        return model
    model = _skeleton(section)
    apply_plan(model, plan, device.type, meshes)
    _to_empty(model, device)
    torch.set_rng_state(rng)
    initialize(reference, protocol, scatter_into(model), device)
    buffers = dict(reference.named_buffers())
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    if device.type == "cuda":  # the units drawn in full stay cached otherwise, in the reserve training measures
        torch.cuda.empty_cache()
    return model
