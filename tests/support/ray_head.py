"""A real Ray head started with `ray start --block` for the tests that need a separate cluster.

The session's in-process Ray (conftest `ray_cluster`) and this head never meet: the head has its own
temp dir and ports, clients reach it only from subprocesses (the `osdp-platform` CLI), and it is
stopped by its own process id. `ray stop` is never used: it would end every Ray on the machine.

Everything listens on 127.0.0.1: the head gets `--node-ip-address`, and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
makes Ray resolve "this node" to the loopback address for the nodes the fake autoscaler starts and
for the clients, where it would otherwise pick the machine's outward address. Token authentication
is off (RAY_AUTH_MODE=disabled) so that no shared ~/.ray/auth_token decides whether a client gets in.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from ray.util.state import list_actors, list_nodes

from helpers import TEST_PATH

LOOPBACK = "127.0.0.1"
VENV_BIN = str(Path(sys.executable).parent)
# The fake provider's head id: the autoscaler knows the head by it (autoscaler v2).
FAKE_HEAD_NODE_ID = "f" * 51 + "00000"
STOP_TIMEOUT_S = 30
LEFTOVER_GRACE_S = 3  # for the fake nodes' processes to go on SIGTERM once the head is down


def client_env() -> dict[str, str]:
    """The environment for a client of the head (a CLI subprocess): loopback only, no token."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _free_ports(count: int) -> list[int]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind((LOOPBACK, 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def fake_autoscaling_config(
    gcs_address: str,
    node_types: dict[str, dict[str, float]],
    max_workers: int,
    idle_timeout_s: float,
    no_capacity_file: Path | None = None,
) -> dict[str, Any]:
    """An autoscaler config for Ray's fake multi-node provider: a head without CPUs and on-demand node types.

    The wheel lacks the fake provider's default config, so the provider is named by module (type
    `external`: `tests/support/fake_nodes.py`, Ray's fake provider with a folder of its own per node) and every
    field the defaults would fill is given here.
    """
    workers = {
        name: {"resources": resources, "node_config": {}, "min_workers": 0, "max_workers": max_workers}
        for name, resources in node_types.items()
    }
    return {
        "cluster_name": "osdp-fake",
        "max_workers": max_workers * len(node_types),
        "upscaling_speed": 10.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "external",
            "module": "fake_nodes.FakeNodesWithOwnDisks",
            "gcs_address": gcs_address,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "launch_multiple": True,
            "disable_node_updaters": True,
            "no_capacity_file": str(no_capacity_file) if no_capacity_file else None,
        },
        "auth": {"ssh_user": "ray"},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            **workers,
        },
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@dataclass
class RayHead:
    proc: subprocess.Popen
    temp_dir: Path
    gcs_address: str
    dashboard_url: str
    client_address: str
    no_capacity: Path | None = None  # autoscaling heads: while this file exists, the fake cloud launches no node

    def alive_nodes(self) -> list[dict[str, Any]]:
        """Nodes the head reports alive, through its dashboard (no driver, so nothing to clash with)."""
        nodes = list_nodes(
            address=self.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, raise_on_missing_output=False
        )
        return [{"id": n.node_id, "head": n.is_head_node, "resources": n.resources_total} for n in nodes]

    def worker_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.alive_nodes() if not n["head"]]

    def actor_nodes(self, class_name: str) -> list[str]:
        """The node of every actor of `class_name` this cluster ran, finished ones included."""
        actors = list_actors(
            address=self.dashboard_url,
            filters=[("class_name", "=", class_name)],
            detail=True,
            raise_on_missing_output=False,
        )
        return [a.node_id for a in actors]

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: they all carry its temp dir in their command line or cwd."""
        mine = []
        for proc in psutil.process_iter(["cmdline"]):
            if str(self.temp_dir) in " ".join(proc.info["cmdline"] or []):
                mine.append(proc)
        return mine

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it tears its own processes down), then to what it leaves (the
        fake nodes, which the autoscaler started), then SIGKILL: a raylet whose GCS is gone ignored SIGTERM
        for the whole 30 s the test waited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(left, timeout=STOP_TIMEOUT_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _wait_for_dashboard(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the head's dashboard did not answer within {timeout_s} s:\n{log.read_text()[-3000:]}")


def start_head(
    base: Path,
    num_cpus: int,
    node_types: dict[str, dict[str, float]] | None = None,
    max_workers: int = 2,
    idle_timeout_s: float = 15,
    timeout_s: float = 120,
) -> RayHead:
    """Start a head on 127.0.0.1 with its own ports and temp dir; with `node_types`, an autoscaling one."""
    # Ray's socket paths must stay under 107 bytes: a short folder of its own, not one under `base`
    # (pytest-xdist's temp paths are long), removed by `stop`.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayhead-"))
    gcs, dashboard, client, agent_http, agent_grpc, metrics, runtime_env, node_manager, object_manager = _free_ports(9)
    gcs_address = f"{LOOPBACK}:{gcs}"
    env = client_env()
    env.update(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    cmd = [
        str(Path(VENV_BIN) / "ray"),
        "start",
        "--head",
        "--block",
        f"--node-ip-address={LOOPBACK}",
        f"--port={gcs}",
        f"--dashboard-host={LOOPBACK}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--num-cpus={num_cpus}",
        "--object-store-memory=200000000",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    if node_types is not None:
        config = base / "autoscaling.json"
        no_capacity = base / "no-capacity"
        config.write_text(
            json.dumps(fake_autoscaling_config(gcs_address, node_types, max_workers, idle_timeout_s, no_capacity))
        )
        cmd.append(f"--autoscaling-config={config}")
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [TEST_PATH, env.get("PYTHONPATH")])),  # fake_nodes, test modules
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            RAY_enable_autoscaler_v2="1",
            RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
            RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID,
        )
    log = base / "head.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=base, start_new_session=True)
    head = RayHead(proc, temp_dir, gcs_address, f"http://{LOOPBACK}:{dashboard}", f"ray://{LOOPBACK}:{client}")
    if node_types is not None:
        head.no_capacity = no_capacity
    try:
        _wait_for_dashboard(head.dashboard_url, proc, log, timeout_s)
    except BaseException:
        head.stop()
        raise
    return head
