"""Step time of a plan: compute per unit, FSDP2's collectives by an alpha-beta model, the optimizer step.

Collectives per micro step and unit (bytes as the ring moves them, (g-1)/g of the tensor):
ZeRO-3 and HSDP gather in forward and again in backward and reduce-scatter the gradients (HSDP then
all-reduces its 1/g shard across the replicas); ZeRO-2 gathers once; DP all-reduces the gradients.
On GPUs FSDP2 runs collectives on their own streams, so a unit costs max(compute, communication);
gloo on CPU blocks, so there they add. Each slice of a split operator is an FSDP2 unit of its own:
one more collective latency per gather and per reduction. The optimizer step scales with the
parameters a rank owns. On CPU pools FSDP2's fixed costs (hooks, per-tensor copies, DTensor dispatch
in the optimizer) are measured (see comm_probe) and charged per FSDP2 unit and per tensor; on GPUs
the copies and casts FSDP2 runs on the compute stream, and its host work, are measured per byte and
per further unit of a split at both timing batches, and the optimizer's cost per DTensor
(fsdp_probe). A world of one runs no FSDP2 (runtime.apply), so nothing of it is charged there.
"""

from dataclasses import dataclass

from osdp_planners.comm_probe import CommProfile
from osdp_planners.compute_probe import MeasuredTimes
from osdp_planners.hardware import DevicePreset, LinkSpec
from osdp_planners.options import Option
from osdp_planners.plan import Strategy
from osdp_planners.profile import ModelProfile

BACKWARD_FLOPS_RATIO = 2.0
ADAMW_BYTES_PER_PARAM = 40  # reads and writes of param, grad, two moments, and temporaries (fp32)


@dataclass(frozen=True)
class Topology:
    world_size: int
    workers_per_node: int
    device: DevicePreset
    measured: CommProfile | None = None  # CPU pools: gloo and FSDP2 costs measured on this host

    def link(self, group: int) -> LinkSpec:
        """A group that fits in a node talks over the node's links; a larger one is bound by the network."""
        return self.device.intra_node if group <= self.workers_per_node else self.device.inter_node

    def ring(self, nbytes: float, group: int, calls: int, factor: float = 1.0) -> float:
        """Time of `calls` collectives moving `nbytes` in total among `group` ranks (ring algorithm)."""
        if group <= 1:
            return 0.0
        link = self.link(group)
        return calls * link.latency_s + factor * nbytes * (group - 1) / group / link.bandwidth_bytes_per_s

    @property
    def step_fixed_s(self) -> float:
        """What FSDP2 costs once per forward+backward, whatever the plan (measured on CPU pools)."""
        return self.measured.step_fixed_s if self.measured else 0.0

    def replica_link(self, group: int) -> int:
        """Ranks one shard is all-reduced across in HSDP (or DP): the replicas."""
        return self.world_size // group


@dataclass(frozen=True)
class UnitTime:
    compute_s: float
    comm_s: float
    total_s: float


def compute_seconds(
    profile: ModelProfile, unit: str, batch: int, topo: Topology, measured: MeasuredTimes | None
) -> tuple[float, float]:
    """(forward, backward) seconds of one unit at a micro batch: measured if available, else from FLOPs."""
    if measured is not None:
        return measured.forward[unit].at(batch), measured.backward[unit].at(batch)
    flops = profile.forward_flops(unit, batch)
    fwd = flops / topo.device.flops_per_s
    return fwd, BACKWARD_FLOPS_RATIO * fwd


def recompute_seconds(unit: str, batch: int, fwd: float, measured: MeasuredTimes | None) -> float:
    """What checkpointing adds to a unit: measured where the whole model was timed, else its forward again."""
    if measured is not None and unit in measured.recompute:
        return measured.recompute[unit].at(batch)
    return fwd


def fsdp_units(profile: ModelProfile, unit: str, opt: Option) -> list[int]:
    """Parameter tensors of each FSDP2 unit an option makes of `unit`: every slice of its split
    Linears, then the unit itself with what is left."""
    if opt.split == 1:
        return [profile.tensor_count[unit]]
    linears = profile.linear_tensors[unit]
    return [t for t in linears for _ in range(opt.split)] + [profile.tensor_count[unit] - sum(linears)]


def measured_kind(opt: Option) -> str:
    """The probed strategy an option behaves like: HSDP over groups of one is DP, otherwise ZeRO-3-like."""
    if opt.strategy is Strategy.HSDP:
        return "ddp" if opt.shard_group_size == 1 else "zero3"
    return opt.strategy.value


def _measured_comm(comm: CommProfile, full: float, gathered: float, opt: Option, units: list[int], world: int) -> float:
    """Measured FSDP2 cost of each of its units and tensors, plus the bytes at the measured bandwidths,
    scaled to the model where it was calibrated (see model_probe)."""
    g = opt.shard_group_size
    kind = measured_kind(opt)
    t = sum(comm.unit_cost_s[kind] + comm.tensor_cost_s[kind] * n for n in units)
    if opt.strategy is Strategy.DDP:
        t += 2 * full * (world - 1) / world / comm.bandwidth["all_reduce"]
    else:
        gathers = 1 if opt.strategy is Strategy.ZERO2 else 2
        t += gathers * gathered * (g - 1) / g / comm.bandwidth["all_gather"]
        t += full * (g - 1) / g / comm.bandwidth["reduce_scatter"]
    if opt.strategy is Strategy.HSDP:
        r = world // g
        t += 2 * full / g * (r - 1) / r / comm.bandwidth["all_reduce"]
    return t * comm.scale.get(kind, 1.0)


def comm_seconds(profile: ModelProfile, unit: str, opt: Option, topo: Topology, compute_bytes: int) -> float:
    """Communication of one unit in one micro step (gradients synchronised every micro step)."""
    full = profile.param_bytes[unit]
    gathered = full * compute_bytes / 4
    units = fsdp_units(profile, unit, opt)
    slices = sum(1 for n in units if n)  # collectives per pass (a unit left without tensors has none)
    if topo.measured is not None:
        return _measured_comm(topo.measured, full, gathered, opt, units, topo.world_size)
    g = opt.shard_group_size
    if opt.strategy is Strategy.DDP:
        return topo.ring(full, topo.world_size, slices, factor=2.0)
    gathers = 1 if opt.strategy is Strategy.ZERO2 else 2
    t = topo.ring(gathered, g, gathers * slices, factor=gathers) + topo.ring(full, g, slices)
    if opt.strategy is Strategy.HSDP:
        t += topo.ring(full / g, topo.replica_link(g), slices, factor=2.0)
    return t


def unit_time(
    profile: ModelProfile,
    unit: str,
    opt: Option,
    batch: int,
    topo: Topology,
    measured: MeasuredTimes | None,
    compute_bytes: int,
    overlap: bool,
) -> UnitTime:
    fwd, bwd = compute_seconds(profile, unit, batch, topo, measured)
    compute = fwd + bwd + (recompute_seconds(unit, batch, fwd, measured) if opt.checkpoint else 0.0)
    if measured is not None and topo.world_size > 1:  # FSDP2's copies, casts and hooks (a world of one has none)
        per_byte, per_unit = measured.fsdp_at(measured_kind(opt), batch)
        further = sum(1 for n in fsdp_units(profile, unit, opt) if n) - 1  # a split's slices are units too
        compute += per_byte * profile.param_bytes[unit] + per_unit * further
    comm = comm_seconds(profile, unit, opt, topo, compute_bytes)
    total = max(compute, comm) if overlap else compute + comm
    return UnitTime(compute, comm, total)


def optimizer_seconds(
    profile: ModelProfile, options: dict[str, Option], topo: Topology, measured: MeasuredTimes | None
) -> float:
    """AdamW touches each owned parameter a fixed number of times: memory-bound, linear in the shard.
    Where measured, each DTensor adds its dispatch cost (a world of one has none: no FSDP2)."""
    if measured:
        per_param = measured.optimizer_s_per_param
    else:
        per_param = ADAMW_BYTES_PER_PARAM / topo.device.memory_bandwidth_bytes_per_s
    t = sum(profile.param_bytes[u] / 4 / o.shard_group_size * per_param for u, o in options.items())
    if topo.measured is not None:
        cost = topo.measured.optimizer_tensor_cost_s
    elif measured is not None and topo.world_size > 1:
        cost = measured.optimizer_tensor_cost_s
    else:
        cost = {}
    t += sum(cost.get(measured_kind(o), 0.0) * sum(fsdp_units(profile, u, o)) for u, o in options.items())
    return t
