"""Named hardware presets: what the planner assumes about a device pool when it cannot measure it.

Each GPU preset states its public dense bf16 peak (the denominator of MFU) and a sustained rate for
the cost model: SUSTAINED_MFU x peak, the fraction a hand-written bf16 training loop with eager
kernels was measured to reach on an H200 (llama 1b, seq 2048: 40.0% MFU, issue 23), not the 60% that
tuned kernels reach. A GPU's memory is the capacity CUDA reports for it (torch's "total capacity" in an
out-of-memory message, e.g. 79.1 GiB on an H100 80GB, 139.7-139.8 GiB on an H200), not the marketed size: a
budget of 80 GiB would plan memory an H100 lacks. Link bandwidths are bus bandwidths as nccl-tests
report them. The profiler replaces the times with measured values where the pool is available.
"""

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class LinkSpec:
    """An alpha-beta model of one collective link: time = latency + bytes_on_wire / bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float


SUSTAINED_MFU = 0.40  # measured, see the module docstring


@dataclass(frozen=True)
class DevicePreset:
    name: str
    accelerator: str  # "cpu" or "gpu"
    memory_bytes: int
    peak_flops_per_s: float  # public dense bf16 peak (MFU's denominator); CPU: the sustained rate
    memory_bandwidth_bytes_per_s: float  # sustained; bounds the optimizer step
    intra_node: LinkSpec
    inter_node: LinkSpec
    gpu_name: str = ""  # what CUDA's name of such a GPU contains ("NVIDIA H100 80GB HBM3")

    def describes(self, device_name: str) -> bool:
        """Whether a GPU of this CUDA name is one of this preset's: only then do its timings stand for the pool's."""
        return bool(self.gpu_name) and self.gpu_name in device_name

    @property
    def flops_per_s(self) -> float:
        """The sustained rate the cost model divides FLOPs by where the model was not timed."""
        return self.peak_flops_per_s * (SUSTAINED_MFU if self.accelerator == "gpu" else 1.0)


NVLINK_A100, IB_A100 = LinkSpec(10e-6, 230e9), LinkSpec(20e-6, 23e9)
NVLINK_HOPPER, IB_HOPPER = LinkSpec(8e-6, 360e9), LinkSpec(15e-6, 46e9)
PCIE_TITAN, ETHERNET_TITAN = LinkSpec(20e-6, 10e9), LinkSpec(50e-6, 1.2e9)

PRESETS: dict[str, DevicePreset] = {
    p.name: p
    for p in (
        DevicePreset("a100-40gb", "gpu", int(39.3 * GIB), 312e12, 1.3e12, NVLINK_A100, IB_A100, "A100"),
        DevicePreset("a100-80gb", "gpu", int(79.1 * GIB), 312e12, 1.6e12, NVLINK_A100, IB_A100, "A100"),
        DevicePreset("h100-80gb", "gpu", int(79.1 * GIB), 989e12, 2.6e12, NVLINK_HOPPER, IB_HOPPER, "H100"),
        DevicePreset("h200-141gb", "gpu", int(139.7 * GIB), 989e12, 3.8e12, NVLINK_HOPPER, IB_HOPPER, "H200"),
        DevicePreset("rtx-titan-24gb", "gpu", int(23.6 * GIB), 130e12, 0.5e12, PCIE_TITAN, ETHERNET_TITAN, "TITAN RTX"),
        # CPU workers with gloo on one host: the figures measured in FSDP2_NOTES (2 ranks, 2 cores).
        DevicePreset("cpu", "cpu", 8 * GIB, 20e9, 5e9, LinkSpec(0.6e-3, 0.6e9), LinkSpec(1e-3, 0.1e9)),
    )
}


def get_preset(name: str) -> DevicePreset:
    """Look up a preset; the caller turns KeyError into a user-facing error."""
    return PRESETS[name]
