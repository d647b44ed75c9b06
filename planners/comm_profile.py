"""Measured communication on a CPU pool: gloo collectives and FSDP2's per-unit cost, on real processes.

On CPU every collective blocks and FSDP2's Python hooks cost as much as the bytes moved, so presets
cannot predict a step. This starts `world` gloo processes on this host (the workers of a CPU pool
are processes like these), times all-gather, reduce-scatter and all-reduce of a large tensor
(bandwidth), and times a stack of tiny FSDP2 units under each strategy against the same stack
unsharded (the fixed cost one unit adds per step).
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

LARGE = 4 << 20  # bytes of the bandwidth probes
UNITS, WIDTH, REPEATS = 6, 16, 12
STRATEGIES = ("ddp", "zero2", "zero3")
MEASURE_TIMEOUT_S = 300


@dataclass(frozen=True)
class CommProfile:
    world_size: int
    bandwidth: dict[str, float]  # all_gather / reduce_scatter / all_reduce -> bus bytes per second
    unit_cost_s: dict[str, float]  # strategy -> seconds one FSDP2 unit adds to a step, bytes aside


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(UNITS)))


def _step_time(model: nn.Module) -> float:
    x = torch.randn(4, WIDTH)
    return _median_time(lambda: model(x).sum().backward())


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = LARGE // 4
    full, part = torch.zeros(n), torch.zeros(n // world)
    bus = (world - 1) / world * LARGE
    bandwidth = {
        "all_gather": bus / _median_time(lambda: dist.all_gather_into_tensor(full, part), 5),
        "reduce_scatter": bus / _median_time(lambda: dist.reduce_scatter_tensor(part, full), 5),
        "all_reduce": 2 * bus / _median_time(lambda: dist.all_reduce(full), 5),
    }
    plain = _step_time(_stack())
    meshes = {"ddp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")),
              "zero": init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))}
    cost = {}
    for strategy in STRATEGIES:
        model = _stack()
        mesh = meshes["ddp" if strategy == "ddp" else "zero"]
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=strategy == "zero3")
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        cost[strategy] = max(_step_time(model) - plain, 0.0) / UNITS
    if rank == 0:
        out.write_text(json.dumps(asdict(CommProfile(world, bandwidth, cost))))
    dist.barrier()
    dist.destroy_process_group()


def measure_comm(world_size: int) -> CommProfile:
    """Start `world_size` gloo processes on this host and measure (seconds).

    Plain subprocesses, not multiprocessing: spawn would re-import the caller's __main__.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        port = _free_port()
        cmd = [sys.executable, "-m", "osdp_planners.comm_profile", str(world_size), str(port), str(out)]
        procs = [subprocess.Popen([*cmd[:3], str(rank), *cmd[3:]], cwd=tmp) for rank in range(world_size)]
        codes = [p.wait(timeout=MEASURE_TIMEOUT_S) for p in procs]
        if any(codes) or not out.is_file():
            raise RuntimeError(f"measuring gloo collectives failed (exit codes {codes})")
        return CommProfile(**json.loads(out.read_text()))


def cache_path(world_size: int) -> Path:
    """One measurement per host, torch version and world size (what it depends on)."""
    root = Path(os.environ.get("OSDP_CACHE_DIR", Path.home() / ".cache" / "osdp-platform"))
    return root / f"comm-{socket.gethostname()}-torch{torch.__version__}-w{world_size}.json"


def cached_comm(world_size: int) -> CommProfile:
    path = cache_path(world_size)
    if path.is_file():
        return CommProfile(**json.loads(path.read_text()))
    profile = measure_comm(world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile)))
    return profile


if __name__ == "__main__":
    _rank, _world, _port, _out = sys.argv[1:5]
    _worker(int(_rank), int(_world), int(_port), Path(_out))
