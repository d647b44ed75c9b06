"""A plan node that Ray puts on two machines, on a cluster of Ray's fake multi-node provider.

Two nodes of 3 workers each pass the driver's pool check for 2 plan nodes of 2; a detached actor holds
2 of one node's 3, so Ray must place the 4 workers 3 and 1 and one plan node lands on both machines.
The workers report where they run and the run says so: a warning and the `split_plan_nodes` tag.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import CLI, RECIPES
from osdp_platform.tracking.keys import Tag
from ray_head import client_env, start_head

pytestmark = pytest.mark.heavy

NODE = {"CPU": 3, "SPLIT": 3}
HOLD = """
import ray, sys
ray.init(address=sys.argv[1], log_to_driver=False, namespace="placement")
@ray.remote(num_cpus=0, resources={"SPLIT": 2})
class Hold:
    def node(self):
        return ray.get_runtime_context().get_node_id()
hold = Hold.options(name="hold", lifetime="detached").remote()
print(ray.get(hold.node.remote()))
"""
ASK = """
import ray, sys
from ray.autoscaler.sdk import request_resources
ray.init(address=sys.argv[1], log_to_driver=False)
request_resources(bundles=[%r] * 2)
"""


def test_a_plan_node_placed_on_two_machines_is_a_warning_and_a_tag(tmp_path: Path) -> None:
    head = start_head(tmp_path, num_cpus=0, node_types={"split": {**NODE, "object_store_memory": 100_000_000}})
    try:
        subprocess.run([sys.executable, "-c", ASK % NODE, head.gcs_address], env=client_env(), check=True, timeout=120)
        deadline = time.monotonic() + 180
        while len(head.worker_nodes()) < 2:
            assert time.monotonic() < deadline, "2 worker nodes not up within 180 s"
            time.sleep(1)
        subprocess.run([sys.executable, "-c", HOLD, head.gcs_address], env=client_env(), check=True, timeout=120)
        run = subprocess.run(
            [
                CLI,
                "submit",
                str(RECIPES / "tiny.yaml"),
                "hardware.workers_per_node=2",
                "hardware.nodes=2",
                "hardware.pool=SPLIT",
                "hardware.memory_per_device_gb=1",
                "train.steps=2",
                f"tracking.uri=sqlite:///{tmp_path}/m.db",
                "--address",
                head.gcs_address,
            ],
            cwd=tmp_path,
            env=client_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        head.stop()
    said = " ".join(run.stdout.split())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "warning: plan node " in said and "on machines 0, 1" in said and "hardware.workers_per_node (2)" in said
    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    (found,) = client.search_runs([client.get_experiment_by_name("osdp-tiny").experiment_id])
    assert found.data.tags[Tag.SPLIT_PLAN_NODES].startswith("plan node ")
