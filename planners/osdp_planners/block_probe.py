"""Compute times of a model too large for one device: each distinct unit module timed alone, then scaled.

The model's forward runs once on meta tensors with a hook before every unit module, which records
the arguments it is called with (shapes and dtypes only). Each distinct module (same class,
parameter shapes and argument shapes: the blocks of a decoder are one) is then built alone on the
device, in the compute dtype, fed random arguments of those shapes, and timed forward and backward
at both timing batches, plain and checkpointed (what recomputation adds); every unit is charged its
modules' times, and the loss on the logits is timed on its own and charged to the last unit. The
optimizer's rate per parameter comes from the largest distinct module; on a GPU what FSDP2 adds
(fsdp_probe), from a chain of copies of one layer (one unit of each kind that repeats). Nothing
larger than a few layers is ever on the device.
"""

import copy
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functional_call

from osdp_planners.comm_probe import shard_uniform
from osdp_planners.compute_probe import (
    REPEATS,
    TIMING_BATCHES,
    MeasuredTimes,
    device_memory,
    median_step,
    probe_fits,
    sync,
)
from osdp_planners.fsdp_probe import Added, Call, Chain, added_costs, charge, finer, median_pass
from osdp_planners.loss import lm_loss, logits_of
from osdp_planners.profile import Linear1
from osdp_planners.runtime import compile_units, compute_dtype, make_optimizer
from osdp_planners.torch_private import checkpoint, tree_leaves, tree_map
from osdp_planners.trace import fake_state
from osdp_planners.units import ROOT, Unit, find_units

CHAIN = 4  # copies of a layer FSDP2's costs are measured on (fsdp_probe.Chain), at most


class Captured(NamedTuple):
    calls: dict[str, Call]  # module path -> the (args, kwargs) it is first called with
    logits_width: int  # the model's vocabulary: the loss is over it, whatever range the data's tokens take


def _capture(model: nn.Module, paths: list[str], batch: int, seq_len: int, dtype: torch.dtype) -> Captured:
    """The (args, kwargs) each module in `paths` is first called with, on fake tensors with parameters in
    the compute `dtype` (as the profile traces the model), and the width of the logits. Grad mode is on, so
    an argument requires a gradient exactly where training's does (activations, not rotary tables)."""
    calls: dict[str, Call] = {}
    hooks = []
    for path in paths:

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
            calls.setdefault(path, (args, kwargs))

        hooks.append(model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with fake_state(model, dtype) as (fakes, device), torch.enable_grad():
            tokens = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
            logits = logits_of(functional_call(model, fakes, (tokens,)))
    finally:
        for h in hooks:
            h.remove()
    return Captured(calls, logits.shape[-1])


def _signature(module: nn.Module, call: Call) -> tuple[object, ...]:
    leaves = [(tuple(t.shape), t.dtype) for t in tree_leaves(call) if isinstance(t, torch.Tensor)]
    params = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    return type(module).__qualname__, tuple(params), tuple(leaves)


def _materialise(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of `module` on `device` with random weights in the compute dtype (values do not matter to time),
    its tied parameters still tied (leaving the meta device makes each name a new parameter)."""
    real = copy.deepcopy(module)
    first: dict[int, str] = {}
    ties = [(name, first.setdefault(id(p), name)) for name, p in real.named_parameters(remove_duplicate=False)]
    real.to_empty(device=device)
    for name, tied_to in ties:
        if name != tied_to:
            owner, _, attr = name.rpartition(".")
            setattr(real.get_submodule(owner), attr, real.get_parameter(tied_to))
    with torch.no_grad():
        for t in [*real.parameters(), *real.buffers()]:
            t.normal_(0, 0.02) if t.is_floating_point() or t.is_complex() else t.zero_()
    for p in real.parameters():
        p.data = p.data.to(dtype)
    return real


def _inputs(call: Call, device: torch.device, dtype: torch.dtype, vocab_size: int) -> Call:
    """Random tensors of the captured shapes. Floating ones are in the compute dtype, as everything the
    compute copy's parameters make is (a rotary table too), and get a gradient where the captured one
    would have one. Integers are token ids or positions: drawn below both the vocabulary and their last
    dimension (the sequence), they index either. A boolean mask hides nothing, but transformers' causal
    mask (a boolean `attention_mask`) becomes None: it builds one on fake tensors, while on a device,
    with nothing padded, its SDPA gets none and masks causally in the kernel (flash attention)."""

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            return torch.randn(t.shape, device=device, dtype=dtype, requires_grad=t.requires_grad)
        if t.is_complex():
            return torch.randn(t.shape, device=device, dtype=t.dtype)
        if t.dtype == torch.bool:
            return torch.ones(t.shape, device=device, dtype=torch.bool)
        high = min(vocab_size, t.shape[-1]) if t.dim() else 1
        return torch.randint(0, max(high, 1), t.shape, device=device, dtype=t.dtype)

    def causal(key: str, value: Any) -> bool:
        return key == "attention_mask" and isinstance(value, torch.Tensor) and value.dtype == torch.bool

    args, kwargs = call
    return tuple(tree_map(real, a) for a in args), {
        k: None if causal(k, v) else tree_map(real, v) for k, v in kwargs.items()
    }


def _median_pass(
    forward: Callable[[], Any], backward: Callable[[Any], None], device: torch.device
) -> tuple[float, float]:
    """Median seconds of `forward()` and of `backward(its output)`, after one warm-up pass."""
    fwd, bwd = [], []
    for i in range(REPEATS + 1):
        sync(device)
        t0 = time.perf_counter()
        out = forward()
        sync(device)
        t1 = time.perf_counter()
        backward(out)
        sync(device)
        if i:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _time_module(module: nn.Module, call: Call, device: torch.device) -> tuple[float, float]:
    """Forward, and backward from a gradient of ones on every output that has one. The ones are made in the
    warm-up pass only: in the model the module after this one makes that gradient, and is charged for it
    (on this CPU, fresh ones of 32 MB added 30 ms to a head's 39 ms pass: a page fault per 4 KiB)."""
    args, kwargs = call
    grads: list[torch.Tensor] = []

    def backward(out: Any) -> None:
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grads:
            grads.extend(torch.ones_like(t) for t in outs)
        torch.autograd.backward(outs, grads)

    return _median_pass(lambda: module(*args, **kwargs), backward, device)


def _time_loss(logits: torch.Tensor, targets: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """The loss and its gradient, which in the model flows on into the head (never added to a `.grad`)."""

    def backward(loss: torch.Tensor) -> None:
        torch.autograd.grad(loss, logits)

    return _median_pass(lambda: lm_loss(logits, targets), backward, device)


def measure_blocks(
    build: Callable[[str], nn.Module],
    seq_len: int,
    vocab_size: int,
    device: torch.device,
    precision: str = "fp32",
    optimizer: str = "adamw",
    world: int = 1,
    compile: bool = False,
    batches: tuple[int, int] = TIMING_BATCHES,
) -> MeasuredTimes:
    """Per-unit forward and backward lines through the micro `batches`, the optimizer's seconds per
    parameter and, on a GPU, what FSDP2 adds at each of them for a rank of `world` (fsdp_probe, on a
    chain of copies of one layer), block by block."""
    meta = build("meta")
    dtype = compute_dtype(precision)
    units = [u for u in find_units(meta, seq_len) if u.name != ROOT]
    paths = [p for u in units for p in u.modules]
    timed: dict[tuple[object, ...], tuple[float, float, float]] = {}
    per_batch: dict[int, dict[str, tuple[float, float, float]]] = {}
    modules = {p: meta.get_submodule(p) for p in paths}
    sizes = {p: sum(q.numel() for q in m.parameters()) for p, m in modules.items()}
    largest = max(paths, key=sizes.__getitem__)
    layer = fsdp_layer(meta, units)
    probe_calls: dict[int, list[Call]] = {}
    for batch in batches:
        calls, width = _capture(meta, paths, batch, seq_len, dtype)
        seconds = {}
        for path in paths:
            module = meta.get_submodule(path)
            key = _signature(module, calls[path])
            if key not in timed:
                real = _materialise(module, device, dtype)
                if compile:
                    compile_units(real, [""])
                inputs = _inputs(calls[path], device, dtype, vocab_size)
                plain = _time_module(real, inputs, device)
                checkpoint(real)  # then what recomputation adds, as the runtime checkpoints the module
                timed[key] = (*plain, sum(_time_module(real, inputs, device)) - sum(plain))
                del real
            seconds[path] = timed[key]
        probe_calls[batch] = [calls[p] for p in _called(layer)]
        logits = torch.randn(batch, seq_len, width, device=device, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        seconds["<loss>"] = (*_time_loss(logits, targets, device), 0.0)  # the loss is never checkpointed
        per_batch[batch] = seconds
    b1, b2 = batches

    def line(unit_paths: list[str], kind: int) -> Linear1:
        at = [sum(per_batch[b][p][kind] for p in unit_paths) for b in (b1, b2)]
        fit = Linear1.fit(at[0], at[1], b1, b2)
        return Linear1(max(fit.a, 0.0), max(fit.b, 0.0))

    charged = {u.name: [*u.modules, *(["<loss>"] if u is units[-1] else [])] for u in units}
    forward = {name: line(ps, 0) for name, ps in charged.items()} | {ROOT: Linear1(0.0, 0.0)}
    backward = {name: line(ps, 1) for name, ps in charged.items()} | {ROOT: Linear1(0.0, 0.0)}
    recompute = {u.name: line(list(u.modules), 2) for u in units}
    rate = _optimizer_rate(modules[largest], device, optimizer)
    times = MeasuredTimes(forward, backward, rate, recompute=recompute, batches=batches)
    if device.type != "cuda" or world == 1:  # a world of one runs no FSDP2
        return times
    return charge(times, _fsdp_added(meta, layer, probe_calls, device, precision, world, optimizer))


def fsdp_layer(meta: nn.Module, units: list[Unit]) -> list[Unit]:
    """The units FSDP2's costs are measured on: the first of each kind that repeats (class and parameter
    shapes: a decoder layer's attention and MLP), in the model's order. Their cost per byte is charged
    to every unit, so the repeating kinds must hold most of the model; where they do not (only a norm
    repeats), the largest unit is measured alone."""

    def kind(unit: Unit) -> tuple[object, ...]:
        modules = [meta.get_submodule(p) for p in unit.modules]
        return tuple((type(m).__qualname__, tuple(tuple(p.shape) for p in m.parameters())) for m in modules)

    kinds = [kind(u) for u in units]
    repeated = [kinds.count(k) > 1 for k in kinds]
    if 2 * sum(u.param_count for u, r in zip(units, repeated, strict=True) if r) < sum(u.param_count for u in units):
        return [max(units, key=lambda u: u.param_count)]
    return [u for i, u in enumerate(units) if repeated[i] and kinds.index(kinds[i]) == i]


def chain_length(layer_params: int, memory: int | None) -> int:
    """Copies of a layer the probe chains: CHAIN where their training states fit the probe's share of the
    device, fewer where not (a 70b layer on an 80 GB GPU: 2), never one (a unit alone has no neighbour)."""
    return max([k for k in range(2, CHAIN + 1) if probe_fits(k * layer_params, memory)], default=2)


def _called(layer: list[Unit]) -> list[str]:
    """The layer's modules that are not inside another of them (those run inside their parent's forward)."""
    paths = [p for unit in layer for p in unit.modules]
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


def _fsdp_added(
    meta: nn.Module,
    layer: list[Unit],
    calls: dict[int, list[Call]],
    device: torch.device,
    precision: str,
    world: int,
    optimizer: str,
) -> dict[str, Added]:
    """What FSDP2 adds to a chain of copies of `layer`'s units at each batch timed (`calls`: the arguments
    of its called modules there), for rank 0 of `world`; per byte it is the model's (the inputs are
    activations: any integer ids among them only need to index a vocabulary of one)."""
    called = _called(layer)
    layer_modules = nn.ModuleList(meta.get_submodule(p) for p in called)  # one copy keeps their ties
    length = chain_length(sum(p.numel() for p in layer_modules.parameters()), device_memory(device))
    inputs = {b: [_inputs(c, device, compute_dtype(precision), 1) for c in cs] for b, cs in calls.items()}

    def copies(dtype: torch.dtype) -> Chain:
        made = [
            dict(zip(called, _materialise(layer_modules, device, dtype).children(), strict=True)) for _ in range(length)
        ]

        def inside(copy: dict[str, nn.Module], path: str) -> nn.Module:
            top = next(p for p in called if path == p or path.startswith(p + "."))
            return copy[top].get_submodule(path[len(top) + 1 :])

        units = [[inside(copy, p) for p in unit.modules] for copy in made for unit in layer]
        linears = [[inside(copy, p) for p in unit.linears] for copy in made for unit in layer]
        return Chain([list(copy.values()) for copy in made], units, linears)

    def sharded(strategy: str, meshes: dict[str, DeviceMesh], fine: bool) -> nn.Module:
        chain = copies(torch.float32)
        units = finer(chain.units, chain.linears) if fine else chain.units
        return shard_uniform(chain, units, strategy, meshes, precision)

    def run(live: nn.Module, batch: int) -> None:
        outs = [t for t in tree_leaves(live(inputs[batch])) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    plain = copies(compute_dtype(precision))
    plain_s = {b: median_pass(partial(run, plain, b), device) for b in calls}
    del plain
    return added_costs(sharded, run, device, world, plain_s, optimizer)


def _optimizer_rate(module: nn.Module, device: torch.device, optimizer: str) -> float:
    """Seconds per parameter of the runtime's optimizer stepping one module's fp32 weights."""
    real = _materialise(module, device, torch.float32)
    for p in real.parameters():
        p.grad = torch.zeros_like(p)
    step_s = median_step(make_optimizer(real.parameters(), optimizer, device.type), device)
    return step_s / max(sum(p.numel() for p in real.parameters()), 1)
