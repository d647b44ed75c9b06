"""Ray's fake multi-node provider with one runtime-env folder per fake node (loaded by the test head's autoscaler).

All fake nodes live in the head's session folder on this one machine. A node unpacks a job's
working directory into its runtime-env folder and replaces it whenever it sets up a worker for the
job, so with one shared folder a node starting the planner actor would pull the working directory
out from under the job's driver on the head. Real nodes each have their own disk; here each fake
node gets its own folder.
"""

import functools
import time
import uuid
from pathlib import Path
from unittest import mock

import ray._private.parameter
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class FakeNodesWithOwnDisks(FakeMultiNodeProvider):
    """Also a cloud that can run out: while the file the config names `no_capacity_file` exists, a launch
    waits (as a KubeRay worker pod stays pending until the cluster has room for it), so a test decides
    when a lost node comes back. The autoscaler launches from a thread pool: a waiting launch holds one
    of its threads, not the autoscaler."""

    def create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):  # type: ignore[no-untyped-def]
        hold = self.provider_config.get("no_capacity_file")
        while hold and Path(hold).exists():
            time.sleep(0.5)
        super().create_node_with_resources_and_labels(node_config, tags, count, resources, labels)

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):  # type: ignore[no-untyped-def]
        params = functools.partial(
            ray._private.parameter.RayParams, runtime_env_dir_name=f"runtime_resources_{uuid.uuid4().hex[:8]}"
        )
        with mock.patch.object(ray._private.parameter, "RayParams", params):
            super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
