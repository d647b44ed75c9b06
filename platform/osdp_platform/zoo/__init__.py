"""Model zoo: plain PyTorch decoder LMs (llama, gpt2, opt) in named size presets.

All families share one module layout (see :mod:`.layers`), so planners can treat any zoo model
the same way. The caller chooses the device, e.g. ``with torch.device("meta"):`` for planning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from osdp_planners.torch_private import detect_fake_mode

from . import gpt2, llama, opt
from .layers import ZooConfig, ZooModel

FAMILIES: dict[str, dict[str, ZooConfig]] = {
    "llama": llama.PRESETS,
    "gpt2": gpt2.PRESETS,
    "opt": opt.PRESETS,
}

_MODELS: dict[str, Callable[[ZooConfig], ZooModel]] = {"llama": llama.Llama, "gpt2": gpt2.GPT2, "opt": opt.OPT}


def zoo_sizes() -> dict[str, list[str]]:
    """Family -> its size names, in preset order."""
    return {family: list(sizes) for family, sizes in FAMILIES.items()}


def zoo_config(family: str, size: str, **overrides: int | float | None) -> ZooConfig:
    """Resolve a preset plus overrides of its fields (n_layers, vocab_size, ...), e.g. a shallow OPT-30B."""
    if family not in FAMILIES:
        raise ValueError(f"unknown zoo family {family!r}; choose one of {sorted(FAMILIES)}")
    sizes = FAMILIES[family]
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for zoo family {family!r}; choose one of {list(sizes)}")
    fields = {f.name for f in dataclasses.fields(ZooConfig)} - {"family", "size"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown zoo model option(s) {unknown}; choose from {sorted(fields)}")
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}  # fields of several types
    return dataclasses.replace(sizes[size], **given)


def zoo_module(family: str, size: str, **overrides: int | float | None) -> ZooModel:
    """Construct on the current default device with PyTorch's default initialisers (no `init_weights`)."""
    config = zoo_config(family, size, **overrides)  # validates the family before it is looked up
    return _MODELS[family](config)


def build_zoo_model(family: str, size: str, **overrides: int | float | None) -> ZooModel:
    """Construct a zoo model on the current default device, initialised by `init_weights` alone.

    Construction happens on meta, so PyTorch's default initialisers draw nothing from the RNG: the
    weights depend only on the RNG state at the call, exactly as a sharded meta-device build's do.
    On meta or on fake tensors (profiling) there are no values to draw.
    """
    device = torch.get_default_device()
    if device.type == "meta" or detect_fake_mode() is not None:
        return zoo_module(family, size, **overrides)
    with torch.device("meta"):
        model = zoo_module(family, size, **overrides)
    model.to_empty(device=device)
    model.init_weights()
    return model


__all__ = ["FAMILIES", "ZooConfig", "ZooModel", "build_zoo_model", "zoo_config", "zoo_module", "zoo_sizes"]
