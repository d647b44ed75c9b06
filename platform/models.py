"""Build the recipe's model: a zoo entry or the user's own factory, on any device (meta for planning)."""

import importlib

import torch
from torch import nn

from osdp_planners.errors import UserError
from osdp_platform.data import VOCAB_SIZE
from osdp_platform.recipe import ModelSection
from osdp_platform.zoo import build_zoo_model


def _import_factory(target: str):
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError("model.target", target, f"cannot import {module_name!r} ({exc})",
                        "make the module importable (installed, or on PYTHONPATH)") from None
    if not hasattr(module, attr):
        raise UserError("model.target", target, f"{module_name!r} has no attribute {attr!r}",
                        "name a function or class in that module") from None
    return getattr(module, attr)


def build_model(section: ModelSection, device: str | torch.device = "cpu") -> nn.Module:
    """Construct on `device` from the global RNG state (seed first for identical weights on every rank)."""
    with torch.device(device):
        if section.target:
            model = _import_factory(section.target)(**section.kwargs)
            if not isinstance(model, nn.Module):
                raise UserError("model.target", section.target, f"returned {type(model).__name__}, not nn.Module",
                                "return a torch.nn.Module from the factory")
        else:
            try:
                model = build_zoo_model(str(section.family), str(section.size), **section.kwargs)
            except ValueError as exc:
                raise UserError("model", section.model_dump(exclude_none=True), str(exc),
                                "pick a family, size and options from the lists above") from None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and vocab < VOCAB_SIZE:
        raise UserError("model.kwargs.vocab_size", vocab, f"below the byte tokenizer's {VOCAB_SIZE} tokens",
                        f"use vocab_size >= {VOCAB_SIZE}")
    return model
