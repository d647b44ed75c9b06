"""CPU, memory and GPU use of every node of the Ray cluster during a run, sampled on the node itself.

One sampler actor per node, taking no CPU slot, so it never keeps a worker from being placed; it
pushes samples to the driver's inbox (runtime/inbox.py), which the driver writes to MLflow under MLflow's
names for system metrics. psutil gives CPU and memory; NVML (nvidia-ml-py) each GPU's utilisation
and memory where it finds GPUs. Nodes an autoscaler adds during the run get a sampler when seen.
"""

import importlib.util
import itertools
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from osdp_platform.runtime.inbox import NodeSample

SAMPLE_EVERY_S = 10.0
FIRST_SAMPLE_AFTER_S = 1.0  # CPU utilisation is measured between two readings
LOOK_FOR_NODES_EVERY_S = 30.0


def _gpus() -> dict[str, float]:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    out: dict[str, float] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out[f"gpu_{i}_utilization_percentage"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        out[f"gpu_{i}_memory_usage_megabytes"] = memory.used / 1e6
        out[f"gpu_{i}_memory_usage_percentage"] = 100.0 * memory.used / memory.total
    return out


def sample() -> dict[str, float]:
    """This machine's use now; CPU utilisation since the previous call."""
    import psutil

    memory = psutil.virtual_memory()
    return {
        "cpu_utilization_percentage": psutil.cpu_percent(),
        "system_memory_usage_megabytes": memory.used / 1e6,
        "system_memory_usage_percentage": memory.percent,
    } | _gpus()


@ray.remote(num_cpus=0)
class NodeSampler:
    def __init__(self, inbox: Any, node: str, every_s: float) -> None:
        import psutil

        psutil.cpu_percent()
        threading.Thread(target=self._run, args=(inbox, node, every_s), daemon=True).start()

    def _run(self, inbox: Any, node: str, every_s: float) -> None:
        time.sleep(FIRST_SAMPLE_AFTER_S)
        for index in itertools.count():
            inbox.push.remote(NodeSample(node, index, int(time.time() * 1000), sample()))
            time.sleep(every_s)


class NodeSamplers:
    """A sampler on every live node, looking for new nodes now and then, until `stop`."""

    def __init__(self, inbox: Any, every_s: float = SAMPLE_EVERY_S) -> None:
        self.inbox = inbox
        self.every_s = every_s
        self.samplers: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.enabled = importlib.util.find_spec("psutil") is not None

    def start(self) -> "NodeSamplers":
        if self.enabled:
            self._cover_new_nodes()
            threading.Thread(target=self._watch, daemon=True).start()
        return self

    def _watch(self) -> None:
        while not self.stopped.wait(LOOK_FOR_NODES_EVERY_S):
            self._cover_new_nodes()

    def _cover_new_nodes(self) -> None:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        addresses = [n["NodeManagerAddress"] for n in nodes]
        with self.lock:
            for n in nodes:
                if n["NodeID"] in self.samplers or self.stopped.is_set():
                    continue
                address = n["NodeManagerAddress"]
                label = address if addresses.count(address) == 1 else f"{address}-{n['NodeID'][:8]}"
                strategy = NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                self.samplers[n["NodeID"]] = NodeSampler.options(  # type: ignore[attr-defined]
                    scheduling_strategy=strategy
                ).remote(self.inbox, label, self.every_s)

    def stop(self) -> None:
        with self.lock:
            self.stopped.set()
            for sampler in self.samplers.values():
                ray.kill(sampler)
