"""Paths, tiny zoo planning requests and a real MLflow server shared by the tests (tests/support is on
sys.path, pytest's `pythonpath`; the repo root deliberately is not)."""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import requests
import torch

from osdp_planners import PlanRequest, PlanResult, build_context, make_plan_for
from osdp_planners.evaluate import Context
from osdp_planners.hardware import GIB, get_preset
from osdp_platform.driver.cli import JOB_EXECUTION
from osdp_platform.zoo import build_zoo_model

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# every folder of tests/ (not its data): the PYTHONPATH on which a subprocess or a Ray worker unpickles
# what a test module defines
TEST_PATH = os.pathsep.join(
    str(d) for d in sorted(TESTS.rglob("*")) if d.is_dir() and not {"data", "__pycache__"} & set(d.parts)
)
RECIPES = REPO / "recipes"
CLI = str(Path(sys.executable).with_name("osdp-platform"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, artifact folder) that a test may stop and restart."""

    root: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, JOB_EXECUTION: "false"},  # tracking needs none of its job runners (cli.py `ui`)
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{self.uri}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer in time:\n{(self.root / 'server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        """Kill the server and the processes it started (its own process group), as a crash would."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.process.wait(timeout=60)


def zoo_request(
    family: str = "llama",
    workers: int = 4,
    *,
    seq_len: int = 32,
    limit: float = 8 * GIB,
    micro_batch: int | None = None,
    global_batch: int | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    search: str = "auto",
) -> PlanRequest:
    """An OSDP planning request for a tiny zoo model on one node of CPU workers (pure planner tests)."""
    return PlanRequest(
        planner="osdp",
        model_label=f"{family}-tiny",
        nodes=1,
        workers_per_node=workers,
        device=get_preset("cpu"),
        memory_limit_bytes=int(limit),
        seq_len=seq_len,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        precision=precision,
        optimizer=optimizer,
        search=search,
    )


@dataclass(frozen=True)
class ZooModel:
    """A tiny zoo model's constructor on any device, as make_plan_for takes it, with the key that names
    it whole: planned through `plan_zoo` its profile is reused, in this process and on disk, as a
    recipe's model's is (profiling one takes seconds, and the planner tests plan the same few dozens of times)."""

    family: str
    n_layers: int
    vocab_size: int | None = None
    dim: int | None = None

    def __call__(self, device: str) -> torch.nn.Module:
        with torch.device(device):
            return build_zoo_model(
                self.family, "tiny", n_layers=self.n_layers, vocab_size=self.vocab_size, dim=self.dim
            )

    def named_in(self, req: PlanRequest) -> PlanRequest:
        """`req` naming this model whole (`model_key`), as a recipe's request names its model."""
        key = f"zoo:{self.family}:tiny:layers={self.n_layers}:vocab={self.vocab_size}:dim={self.dim}"
        return dataclasses.replace(req, model_key=key)


def plan_zoo(build: ZooModel, req: PlanRequest, measure_on: str | None = None) -> PlanResult:
    """`make_plan_for` on a zoo model, with the request naming that model."""
    return make_plan_for(build, build.named_in(req), measure_on)


@cache
def context(
    family: str,
    n_layers: int = 2,
    workers: int = 4,
    precision: str = "fp32",
    optimizer: str = "adamw",
    vocab_size: int | None = None,
    dim: int | None = None,
    seq_len: int = 32,
    micro_batch: int | None = None,
) -> Context:
    build = ZooModel(family, n_layers, vocab_size, dim)
    req = zoo_request(
        family, workers, precision=precision, optimizer=optimizer, seq_len=seq_len, micro_batch=micro_batch
    )
    return build_context(build, build.named_in(req), None)
