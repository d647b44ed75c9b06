"""Per-rank memory over one training step under FSDP2, simulated event by event.

Activations come from the profile (they do not depend on sharding); on top of them the simulation
tracks what FSDP2 holds: sharded parameters and optimizer state (always), unsharded parameters
(from a unit's all-gather until it reshards: after its forward for ZeRO-3/HSDP, after its backward
for DP/ZeRO-2), the all-gather buffer of the most recent gather (FSDP2 keeps it until the next one,
or until the root's forward ends; backward prefetches one unit ahead), unsharded gradients and the
reduce-scatter buffer (kept until the next reduce-scatter), and sharded gradients from a unit's
backward until the optimizer step.
"""

from dataclasses import dataclass, field

from osdp_planners.options import Option
from osdp_planners.profile import ModelProfile

ADAM_STATES = 2  # exp_avg, exp_avg_sq: fp32, sharded like the parameters


@dataclass(frozen=True)
class UnitBytes:
    """Bytes one rank holds for one unit under one option (fp32 storage, compute dtype when gathered)."""

    sharded: float  # sharded fp32 parameters (a full copy for DP)
    opt_state: float
    grad_shard: float
    gathered: float  # all unsharded parameters of the unit in the compute dtype
    gather_step: float  # the largest single all-gather: the whole unit, or one slice plus the rest
    grad_full: float  # unsharded gradients of the largest gather step, in the compute dtype
    reduce_buffer: float  # the reduce-scatter input for that step, in fp32 (the reduce dtype)


def unit_bytes(profile: ModelProfile, unit: str, opt: Option, compute_bytes: int, opt_states: int) -> UnitBytes:
    full = profile.param_bytes[unit]
    linears = profile.linear_bytes[unit]
    ratio = compute_bytes / 4
    if opt.split > 1 and linears:
        rest = full - sum(linears)
        step = max(linears) / opt.split + rest
    else:
        step = full
    shard = full / opt.group
    return UnitBytes(shard, opt_states * shard, shard, full * ratio, step * ratio, step * ratio, step)


@dataclass
class Timeline:
    """Memory at every event, for the report's plot and for finding the peak."""

    events: list[tuple[str, float]] = field(default_factory=list)

    def add(self, label: str, value: float) -> None:
        self.events.append((label, value))

    @property
    def peak(self) -> float:
        return max(v for _, v in self.events)


def simulate(profile: ModelProfile, options: dict[str, Option], batch: int, compute_bytes: int = 4,
             optimizer: str = "adamw") -> Timeline:
    """Per-rank bytes at each event of one steady-state step (after the first optimizer step)."""
    states = ADAM_STATES if optimizer == "adamw" else 0
    ub = {u: unit_bytes(profile, u, o, compute_bytes, states) for u, o in options.items()}
    base = sum(b.sharded + b.opt_state for b in ub.values())
    saved = _checkpoint_savings(profile, options, batch)
    mods = profile.modules
    last_module = {m.unit: m.path for m in mods}
    first_module = {}
    for m in mods:
        first_module.setdefault(m.unit, m.path)
    tl = Timeline()
    gathered: dict[str, float] = {}
    ag_last = rs_last = grad_shards = 0.0

    def level(act: float) -> float:
        return base + act + sum(gathered.values()) + ag_last + rs_last + grad_shards

    for i, m in enumerate(mods):
        b, o = ub[m.unit], options[m.unit]
        act_off = saved.forward[i]
        if m.path == first_module[m.unit] and m.unit not in gathered:
            tl.add(f"{m.path} all-gather", level(m.pre_fw.at(batch) - act_off) + b.gather_step)
            ag_last = b.gather_step
            gathered[m.unit] = b.gathered if o.holds_params else b.gather_step
        tl.add(f"{m.path} forward", level(m.peak_fw.at(batch) - act_off))
        if m.path == last_module[m.unit] and not o.holds_params:
            gathered.pop(m.unit)
    ag_last = 0.0  # the root's post-forward releases the last all-gather's buffer
    tl.add("loss", level(profile.peak_loss.at(batch) - saved.loss))
    backward_units = list(dict.fromkeys(m.unit for m in reversed(mods)))
    for i, m in reversed(list(enumerate(mods))):
        b = ub[m.unit]
        act_off = saved.backward[i]
        if m.path == last_module[m.unit]:
            if m.unit not in gathered:  # its all-gather was prefetched into the buffer
                gathered[m.unit] = b.gather_step
            pos = backward_units.index(m.unit)
            nxt = backward_units[pos + 1] if pos + 1 < len(backward_units) else None
            if nxt is not None and nxt not in gathered:  # prefetch the next unit of the backward
                ag_last = ub[nxt].gather_step
        own_grads = profile.param_bytes[m.unit] * compute_bytes / 4 - b.grad_full  # profiled: unsplit grads
        tl.add(f"{m.path} backward", level(m.peak_bw.at(batch) - act_off - max(own_grads, 0.0)))
        if m.path == first_module[m.unit]:
            gathered.pop(m.unit)  # FSDP2 reshards before it reduce-scatters
            rs_last = 0.0
            tl.add(f"{m.path} reduce-scatter", level(m.post_bw.at(batch) - act_off) + b.grad_full + b.reduce_buffer)
            rs_last = b.reduce_buffer
            grad_shards += b.grad_shard
    tl.add("optimizer step", level(0.0))
    return tl


@dataclass(frozen=True)
class _Savings:
    forward: list[float]
    loss: float
    backward: list[float]


def _checkpoint_savings(profile: ModelProfile, options: dict[str, Option], batch: int) -> _Savings:
    """Activation bytes checkpointed units do not keep, at each event (they keep only their output)."""
    mods = profile.modules
    n = len(mods)
    kept = [m.post_fw.at(batch) - m.pre_fw.at(batch) - m.output.at(batch) if options[m.unit].checkpoint else 0.0
            for m in mods]
    forward = [sum(kept[:i]) for i in range(n)]
    total = sum(kept)
    backward = [sum(kept[:i]) for i in range(n)]
    return _Savings(forward, total, backward)
