"""Named hardware presets: what the planner assumes about a device pool when it cannot measure it.

Numbers are public peak figures derated to what dense training kernels and NCCL typically reach
(about 60% of peak compute, bus bandwidth as nccl-tests report it). The profiler replaces them with
measured values where the pool is available; they only have to be right to within tens of percent.
"""

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class LinkSpec:
    """An alpha-beta model of one collective link: time = latency + bytes_on_wire / bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class DevicePreset:
    name: str
    accelerator: str  # "cpu" or "gpu"
    memory_bytes: int
    flops_per_s: float  # sustained dense matmul rate in the training dtype
    memory_bandwidth_bytes_per_s: float  # sustained; bounds the optimizer step
    intra_node: LinkSpec
    inter_node: LinkSpec


PRESETS: dict[str, DevicePreset] = {
    p.name: p
    for p in (
        DevicePreset("a100-40gb", "gpu", 40 * GIB, 0.6 * 312e12, 1.3e12, LinkSpec(10e-6, 230e9), LinkSpec(20e-6, 23e9)),
        DevicePreset("a100-80gb", "gpu", 80 * GIB, 0.6 * 312e12, 1.6e12, LinkSpec(10e-6, 230e9), LinkSpec(20e-6, 23e9)),
        DevicePreset("h100-80gb", "gpu", 80 * GIB, 0.6 * 989e12, 2.6e12, LinkSpec(8e-6, 360e9), LinkSpec(15e-6, 46e9)),
        DevicePreset(
            "h200-141gb", "gpu", 141 * GIB, 0.6 * 989e12, 3.8e12, LinkSpec(8e-6, 360e9), LinkSpec(15e-6, 46e9)
        ),
        DevicePreset(
            "rtx-titan-24gb", "gpu", 24 * GIB, 0.6 * 130e12, 0.5e12, LinkSpec(20e-6, 10e9), LinkSpec(50e-6, 1.2e9)
        ),
        # CPU workers with gloo on one host: the figures measured in FSDP2_NOTES (2 ranks, 2 cores).
        DevicePreset("cpu", "cpu", 8 * GIB, 20e9, 5e9, LinkSpec(0.6e-3, 0.6e9), LinkSpec(1e-3, 0.1e9)),
    )
}


def get_preset(name: str) -> DevicePreset:
    """Look up a preset; the caller turns KeyError into a user-facing error."""
    return PRESETS[name]
