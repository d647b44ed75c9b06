"""Planning end to end: profile and time the model, run the chosen planner, assemble the plan.

Every planner (osdp, the uniform baselines, a manual plan file) runs on the same context, so their
predictions are comparable; whatever fails inside reaches the caller as one UserError.
"""

import dataclasses
import hashlib
import inspect
import os
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from osdp_planners.advice import infeasible
from osdp_planners.assemble import explain, to_plan
from osdp_planners.block_probe import measure_blocks
from osdp_planners.comm_probe import CommProfile, cached_comm
from osdp_planners.compute_probe import (
    TIMING_BATCHES,
    MeasuredTimes,
    batches_for,
    device_memory,
    measure_times,
    probe_fits,
)
from osdp_planners.cpu_wait import WaitMeter, quiet
from osdp_planners.disk_cache import PICKLE, cached
from osdp_planners.errors import UserError, UserErrors
from osdp_planners.evaluate import Context
from osdp_planners.explanation import PlanResult
from osdp_planners.hardware import GIB
from osdp_planners.manual import manual_choice
from osdp_planners.model_probe import Training, calibrate, measure_on_ranks
from osdp_planners.osdp import search_osdp
from osdp_planners.plan import Strategy
from osdp_planners.profile import ModelProfile
from osdp_planners.profiler import profile_model
from osdp_planners.request import PlanRequest
from osdp_planners.runtime import compute_dtype
from osdp_planners.time_model import Topology
from osdp_planners.trace import MODEL_CONTRACT
from osdp_planners.uniform import Baselines
from osdp_planners.units import structure_hash

Builder = Callable[[str], nn.Module]  # device name -> model constructed there
PROFILES_KEPT = 8  # models whose profile a process keeps (each is a few hundred small records)
_profiles: OrderedDict[tuple[str, str, int, int, torch.dtype], ModelProfile] = OrderedDict()


# of a cached profile; the code's own changes are in its key (_code_hash), the model builder's are not
PROFILE_CACHE_VERSION = 3  # 2: a transformers model profiled in the compute dtype; 3: grouped mm, CPU SDPA FLOPs


def _code_hash(model: nn.Module) -> str | None:
    """The source a profile depends on: the planner's package and the model's own classes, so that a
    changed profiler or forward (a new zoo block, another transformers release) is profiled again; None
    where a class has no source file (defined in `python -c`): such a profile is not kept on disk."""
    files = set(Path(__file__).parent.glob("*.py"))
    for module in model.modules():
        try:
            files.add(Path(inspect.getfile(type(module))))
        except TypeError:
            return None
    digest = hashlib.sha256()
    for f in sorted(files):
        if not f.is_file():
            return None
        digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def _profile(build: Builder, req: PlanRequest, structure: str, dtype: torch.dtype) -> ModelProfile:
    """The model's profile, once per process and once per host for a model the request names
    in full (`req.model_key`: its whole configuration).

    Profiling runs the model 16 times (on fake tensors; a small model mostly on real ones); every submit plans
    in a fresh process (the planner actor), and a sweep, a restart or a re-plan asks for the same model
    again, so the profile is kept in memory and on disk, keyed by the model, its parameter structure,
    the shapes and the source it was profiled with.
    """
    if req.model_key is None:
        return profile_model(build, req.seq_len, req.token_range, dtype)
    key = (req.model_key, structure, req.seq_len, req.token_range, dtype)
    if key not in _profiles:
        code = _code_hash(build("meta"))

        def fresh() -> ModelProfile:
            return profile_model(build, req.seq_len, req.token_range, dtype)

        if code is None:
            _profiles[key] = fresh()
        else:
            disk_key = hashlib.sha256(f"{key}|{code}".encode()).hexdigest()[:16]
            _profiles[key] = cached(f"profile-v{PROFILE_CACHE_VERSION}", disk_key, fresh, PICKLE)
        while len(_profiles) > PROFILES_KEPT:
            _profiles.popitem(last=False)
    _profiles.move_to_end(key)
    return _profiles[key]


DEVICE_CACHE_VERSION = 9  # of a cached device measurement (8: recomputation; 9: the batches timed)


def _whole_model_fits(build: Builder, device: torch.device) -> bool:
    """Whether the model is timed whole on `device`; otherwise block by block (block_probe)."""
    return probe_fits(sum(p.numel() for p in build("meta").parameters()), device_memory(device))


def _time_on_device(
    build: Builder,
    req: PlanRequest,
    device: torch.device,
    flops: dict[str, float],
    structure: str,
    batches: tuple[int, int] = TIMING_BATCHES,
) -> MeasuredTimes:
    """The model timed on this GPU at the micro `batches`, whole where it fits, else block by block; cached
    on disk per model, shape, training settings, batches, world size and device name, so that planning the
    same model again (another planner, a sweep, a restart at another world size) takes no device time."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    shape = (
        f"{req.model_label}|{structure}|{req.seq_len}|{req.token_range}|{req.precision}|{req.optimizer}|{req.compile}"
    )
    key = hashlib.sha256(f"{shape}|{batches}|{req.world_size}|{name}".encode()).hexdigest()[:16]

    def whole() -> MeasuredTimes | None:
        """The model timed whole, or None where its activations at the timing batch ran out of memory (the
        fit counts only its states: a 1b model at seq 8192 holds more in activations than in states)."""
        try:
            return measure_times(
                build,
                req.seq_len,
                req.token_range,
                device,
                flops,
                req.precision,
                req.optimizer,
                req.world_size,
                req.compile,
                batches,
            )
        except torch.cuda.OutOfMemoryError:
            return None

    def measure() -> dict[str, Any]:
        meter = WaitMeter()
        times = whole() if _whole_model_fits(build, device) else None
        if times is None:
            if device.type == "cuda":  # what the whole model's attempt left cached (its frames are gone)
                torch.cuda.empty_cache()
            times = measure_blocks(
                build,
                req.seq_len,
                req.token_range,
                device,
                req.precision,
                req.optimizer,
                req.world_size,
                req.compile,
                batches,
            )
        return dataclasses.replace(times, cpu_wait_share=meter.share()).to_dict()

    return MeasuredTimes.from_dict(cached(f"device-v{DEVICE_CACHE_VERSION}", key, measure, keep=quiet))


def check_capacity(req: PlanRequest, capacity: int, device_name: str) -> None:
    """Refuse a budget larger than the GPU the planner runs on: its plans would fill memory the pool lacks.

    The planner actor runs on one of the pool's devices, so its capacity is the pool's."""
    if req.memory_limit_bytes <= capacity:
        return
    raise UserError(
        req.budget_key,
        req.budget_value,
        f"budgets {req.memory_limit_bytes / GIB:.2f} GiB per device, more than the {capacity / GIB:.2f} GiB "
        f"this pool's GPU ({device_name}) has",
        f"set hardware.memory_per_device_gb to at most {capacity / GIB:.2f}"
        if req.budget_by_preset
        else f"lower {req.budget_key} to at most {capacity / GIB:.2f}",
    )


def _unit_flops(profile: ModelProfile) -> dict[str, float]:
    """Each unit's forward FLOPs at micro batch 1: the probes share a whole pass's time out by them."""
    return {u.name: profile.forward_flops(u.name, 1) for u in profile.units}


def build_context(build: Builder, req: PlanRequest, measure_on: str | None) -> Context:
    """Profile the model (fake tensors) and, where it runs here, time it for real.

    On a CPU pool the model is timed as the workers of one node run it, concurrently; the
    measurements are cached on disk per model and world size, and the context carries them into
    the run's profile.json artifact.
    """
    dtype = compute_dtype(req.precision)
    structure = structure_hash(build("meta"))
    profile = _profile(build, req, structure, dtype)
    ctx = Context(
        profile,
        Topology(req.world_size, req.workers_per_node, req.device),
        None,
        2 if req.precision == "bf16-mixed" else 4,
        req.optimizer,
        req.usable_memory_bytes,
    )
    if measure_on is None:
        return ctx
    if measure_on == "cpu":
        return timed_on_cpu(build, req, ctx, structure, TIMING_BATCHES)
    device = torch.device(measure_on)
    capacity = device_memory(device)
    if capacity is not None:
        check_capacity(req, capacity, torch.cuda.get_device_name(device))
    return dataclasses.replace(ctx, measured=_time_on_device(build, req, device, _unit_flops(profile), structure))


def timed_on_cpu(build: Builder, req: PlanRequest, ctx: Context, structure: str, batches: tuple[int, int]) -> Context:
    """`ctx` with the model (of parameter `structure`) timed at the micro `batches` on as many concurrent
    CPU ranks as a node runs workers, and, for a pool of several, gloo's and FSDP2's costs calibrated to it."""
    profile, flops = ctx.profile, _unit_flops(ctx.profile)
    ranks = min(req.world_size, req.workers_per_node)
    key = f"{req.model_label}|{structure}|{compute_dtype(req.precision)}"
    train = Training(req.precision, req.optimizer, req.compile)
    measured, overheads = measure_on_ranks(build, req.seq_len, req.token_range, flops, ranks, key, train, batches)
    comm: CommProfile | None = None
    if req.world_size > 1:
        comm = cached_comm(req.world_size)
        if overheads is not None:
            probes = dataclasses.replace(ctx.topo, measured=comm)
            comm = calibrate(comm, overheads, profile, probes, ctx.compute_bytes, measured.optimizer_s_per_param)
    return dataclasses.replace(ctx, measured=measured, topo=dataclasses.replace(ctx.topo, measured=comm))


def make_plan_for(build: Builder, req: PlanRequest, measure_on: str | None = None) -> PlanResult:
    """The plan `req.planner` makes for the model `build(device)` returns (here on meta and fake tensors).

    Whatever fails while planning a model reaches the caller as one UserError (the module, what
    failed, the fix): a user's model is no reason for a traceback.
    """
    try:
        return _make_plan(build, req, measure_on)
    except (UserError, UserErrors):
        raise
    except Exception as exc:
        raise _planning_failed(req, exc) from exc


def _planning_failed(req: PlanRequest, exc: Exception) -> UserError:
    """The innermost frame outside torch says where: the model's code, or the planner's."""
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if f"{os.sep}torch{os.sep}" not in f.filename), None)
    where = f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})" if frame else ""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return UserError(
        "model",
        req.model_label,
        f"the planner could not plan this model: {type(exc).__name__}: {text}{where}",
        f"{MODEL_CONTRACT}. If the model satisfies that, report this with the model to the platform's maintainers",
    )


def _make_plan(build: Builder, req: PlanRequest, measure_on: str | None) -> PlanResult:
    """The plan, searched again where it chose a micro batch far beyond the batches timed: the model is
    timed at that batch too, on a CPU pool's ranks or on this GPU, so that the search prices it from a
    measurement, not from a line carried there. Where the GPU's probe runs out of memory at that batch,
    the first plan stands and says that its times are extrapolated."""
    first = plan_in(build, req, build_context(build, req, measure_on))
    micro = first.plan.micro_batch_size
    measured = first.context.measured
    if measure_on is None or measured is None or not measured.extrapolated_to(micro):
        return first
    structure, batches = first.plan.structure_hash, batches_for(micro)
    if measure_on == "cpu":
        return plan_in(build, req, timed_on_cpu(build, req, first.context, structure, batches))
    again = retimed_on_device(build, req, first.context, structure, torch.device(measure_on), batches)
    return first if again is None else plan_in(build, req, again)


def retimed_on_device(
    build: Builder, req: PlanRequest, ctx: Context, structure: str, device: torch.device, batches: tuple[int, int]
) -> Context | None:
    """`ctx` with the model (of parameter `structure`) timed on `device` at the micro `batches`, or None
    where even block by block (the whole model's probe falls back to it) a block's activations or the
    logits at the larger batch did not fit beside the probe's states."""
    try:
        measured = _time_on_device(build, req, device, _unit_flops(ctx.profile), structure, batches)
    except torch.cuda.OutOfMemoryError:
        measured = None
    if measured is None and device.type == "cuda":  # after the except: its frames held the probe's tensors
        torch.cuda.empty_cache()
    return None if measured is None else dataclasses.replace(ctx, measured=measured)


def plan_in(build: Builder, req: PlanRequest, ctx: Context) -> PlanResult:
    """The plan `req.planner` makes in a context already built (profiled and timed): no probe runs here."""
    model = build("meta")
    baselines = Baselines(ctx, req)  # each found once: the search weighs them, the plan records them
    if req.planner == "osdp":
        choice = search_osdp(ctx, req, baselines)
    elif req.planner == "manual":
        choice = manual_choice(model, req, ctx)
    elif req.planner in {s.value for s in Strategy}:
        choice = baselines.best(Strategy(req.planner))
    else:
        raise UserError(
            "planner.name", req.planner, "is not a known planner", "use osdp, manual, ddp, zero2, zero3 or hsdp"
        )
    if choice is None:
        raise infeasible(ctx, req)
    return PlanResult(to_plan(model, req, ctx, choice, baselines.records()), explain(ctx, choice), ctx)
