"""Offline structural checks for the Kubernetes manifests in infra/.

No cluster is needed: every infra/*.yaml is parsed with PyYAML and checked for facts that a broken
manifest would violate (autoscaling off, GPU counts that disagree, a head that takes GPU work,
a RayJob pointing at a recipe that isn't one of ours, an MLflow Service that misses its pod...).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
MANIFESTS = sorted(INFRA.glob("*.yaml"))

GPU = "nvidia.com/gpu"
GPU_GROUPS = {"gpu-a100-80g", "gpu-h100-80g"}
# Recipes a RayJob may run. recipes/llama.yaml is owned by the recipes work; this list is the
# contract, not a directory scan, so the manifests can't silently point at a stray file.
KNOWN_RECIPES = {"recipes/llama.yaml"}


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _all_docs() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in _load(path)]


def _of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in _all_docs() if doc.get("kind") == kind]


def _one(kind: str) -> dict:
    docs = _of_kind(kind)
    assert len(docs) == 1, f"expected exactly one {kind} in infra/, found {len(docs)}"
    return docs[0]


def _cluster_specs() -> list[tuple[str, dict]]:
    """Every Ray cluster spec in infra/: RayClusters and RayJobs' inline rayClusterSpec."""
    specs = [(f"RayCluster/{d['metadata']['name']}", d["spec"]) for d in _of_kind("RayCluster")]
    specs += [
        (f"RayJob/{d['metadata']['name']}", d["spec"]["rayClusterSpec"])
        for d in _of_kind("RayJob")
        if "rayClusterSpec" in d["spec"]
    ]
    return specs


CLUSTER_SPECS = _cluster_specs()


def _gpu(resources: dict, section: str) -> int:
    return int(resources.get(section, {}).get(GPU, 0))


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _ray_custom_resources(raw: str) -> dict:
    # KubeRay wants the JSON wrapped in an extra pair of double quotes with escaped inner quotes:
    #   resources: '"{\"A100_80GB\": 8}"'
    assert raw.startswith('"') and raw.endswith('"'), f"resources must be wrapped in quotes: {raw!r}"
    return json.loads(raw[1:-1].replace('\\"', '"'))


# --- every manifest --------------------------------------------------------------------------


def test_expected_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"raycluster.yaml", "rayjob-llama.yaml", "mlflow.yaml"} <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_document_has_api_version_kind_and_name(path):
    docs = _load(path)
    assert docs, f"{path.name} holds no YAML documents"
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: top-level document is not a mapping"
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], doc
        assert isinstance(doc.get("kind"), str) and doc["kind"], doc
        assert doc.get("metadata", {}).get("name"), f"{path.name}: {doc['kind']} without metadata.name"


def test_kuberay_resources_use_ray_io_v1():
    docs = _of_kind("RayCluster") + _of_kind("RayJob")
    assert docs, "no KubeRay resources found"
    for doc in docs:
        assert doc["apiVersion"] == "ray.io/v1", (doc["kind"], doc["apiVersion"])


# --- Ray cluster specs (RayCluster and the RayJob's inline copy) -----------------------------


def test_there_is_a_raycluster_and_a_rayjob_cluster():
    kinds = sorted(name.split("/")[0] for name, _ in CLUSTER_SPECS)
    assert kinds == ["RayCluster", "RayJob"], kinds


@pytest.mark.parametrize(("name", "spec"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_autoscaling_is_enabled(name, spec):
    assert spec.get("enableInTreeAutoscaling") is True, name
    opts = spec.get("autoscalerOptions", {})
    assert opts.get("upscalingMode") == "Default", name
    assert isinstance(opts.get("idleTimeoutSeconds"), int) and opts["idleTimeoutSeconds"] > 0, name


@pytest.mark.parametrize(("name", "spec"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_head_takes_no_gpu_work_and_serves_the_dashboard_in_cluster(name, spec):
    head = spec["headGroupSpec"]
    params = head.get("rayStartParams", {})
    assert params.get("num-gpus") == "0", f"{name}: head must advertise num-gpus '0'"
    assert params.get("dashboard-host") == "0.0.0.0", f"{name}: dashboard must listen on all interfaces"
    for c in head["template"]["spec"]["containers"]:
        res = c.get("resources", {})
        assert _gpu(res, "requests") == 0 and _gpu(res, "limits") == 0, f"{name}: head container {c['name']}"


@pytest.mark.parametrize(("name", "spec"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_gpu_worker_groups(name, spec):
    groups = spec["workerGroupSpecs"]
    names = [g["groupName"] for g in groups]
    assert len(names) == len(set(names)), f"{name}: duplicate groupName in {names}"
    assert set(names) >= GPU_GROUPS, f"{name}: missing {GPU_GROUPS - set(names)}"

    for g in groups:
        where = f"{name}/{g['groupName']}"
        pod = g["template"]["spec"]
        res = pod["containers"][0].get("resources", {})
        req, lim = _gpu(res, "requests"), _gpu(res, "limits")
        if g["groupName"] not in GPU_GROUPS and lim == 0:
            continue  # a CPU-only group would be fine; the GPU rules below don't apply

        assert lim > 0, f"{where}: no {GPU} limit"
        assert req == lim, f"{where}: {GPU} request {req} != limit {lim}"
        assert g["minReplicas"] == 0, f"{where}: GPU groups must scale from 0"
        assert g["minReplicas"] <= g["maxReplicas"], where
        assert g["maxReplicas"] > 0, where
        if "replicas" in g:
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], where

        params = g.get("rayStartParams", {})
        if "num-gpus" in params:
            assert int(params["num-gpus"]) == lim, f"{where}: num-gpus {params['num-gpus']} != limit {lim}"
        if "resources" in params:
            custom = _ray_custom_resources(params["resources"])
            assert custom and all(isinstance(v, (int, float)) and v > 0 for v in custom.values()), where

        assert pod.get("nodeSelector"), f"{where}: no nodeSelector for the accelerator pool"
        assert any(t.get("key") == GPU for t in pod.get("tolerations", [])), f"{where}: no {GPU} toleration"

        shm_volumes = {
            v["name"] for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        shm_mounts = {
            m["name"] for m in pod["containers"][0].get("volumeMounts", []) if m["mountPath"] == "/dev/shm"
        }
        assert shm_mounts and shm_mounts <= shm_volumes, f"{where}: /dev/shm must be a Memory emptyDir"


@pytest.mark.parametrize(("name", "spec"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_ray_version_matches_the_dockerfile(name, spec):
    dockerfile = (INFRA / "Dockerfile").read_text()
    m = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert m, "infra/Dockerfile must set ARG RAY_VERSION=<x.y.z>"
    assert "rayproject/ray:${RAY_VERSION}" in dockerfile
    assert spec["rayVersion"] == m.group(1), f"{name}: rayVersion {spec['rayVersion']} != image {m.group(1)}"


@pytest.mark.parametrize(("name", "spec"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_all_ray_containers_share_one_image(name, spec):
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    images = {p["spec"]["containers"][0]["image"] for p in pods}
    assert len(images) == 1, f"{name}: head and workers must run the same image, got {images}"


# --- RayJob ----------------------------------------------------------------------------------


def test_rayjob_runs_a_known_recipe_through_the_cli():
    for job in _of_kind("RayJob"):
        argv = shlex.split(job["spec"]["entrypoint"])
        assert argv[:2] == ["osdp-platform", "submit"], argv
        assert len(argv) >= 3, argv
        assert argv[2] in KNOWN_RECIPES, f"{argv[2]} is not one of {sorted(KNOWN_RECIPES)}"
        assert "tracking.uri=$MLFLOW_TRACKING_URI" in argv[3:], argv


def test_rayjob_waits_for_the_autoscaler_when_gpu_groups_start_empty():
    # The platform refuses to start when the cluster has fewer GPUs than the pool, unless the
    # recipe says the cluster autoscales; a cluster whose GPU groups start at 0 always needs it.
    for job in _of_kind("RayJob"):
        groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        starts_empty = all(g.get("replicas", g["minReplicas"]) == 0 for g in groups)
        argv = shlex.split(job["spec"]["entrypoint"])
        if starts_empty:
            assert "hardware.autoscaling=true" in argv[3:], argv


def test_rayjob_cleans_up_after_itself():
    for job in _of_kind("RayJob"):
        spec = job["spec"]
        assert spec.get("shutdownAfterJobFinishes") is True
        ttl = spec.get("ttlSecondsAfterFinished")
        assert isinstance(ttl, int) and ttl >= 0, ttl
        # Cleanup only applies to a cluster the job created itself.
        assert "rayClusterSpec" in spec and "clusterSelector" not in spec


def test_rayjob_cluster_is_a_copy_of_the_raycluster():
    cluster = _one("RayCluster")
    job = _one("RayJob")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"], (
        "infra/rayjob-llama.yaml rayClusterSpec drifted from infra/raycluster.yaml spec"
    )


def test_mlflow_uri_reaches_the_mlflow_service():
    svc = _one("Service")
    svc_port = svc["spec"]["ports"][0]["port"]
    job = _one("RayJob")

    submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    # The submitter's shell expands $MLFLOW_TRACKING_URI in the entrypoint; the driver runs on the head.
    for where, container in (("submitter", submitter), ("head", head)):
        uri = _env(container).get("MLFLOW_TRACKING_URI")
        assert uri, f"{where} container does not set MLFLOW_TRACKING_URI"
        parsed = urlparse(uri)
        assert parsed.scheme == "http", uri
        assert parsed.hostname.split(".")[0] == svc["metadata"]["name"], uri
        assert parsed.port == svc_port, f"{uri} does not use Service port {svc_port}"


# --- MLflow ----------------------------------------------------------------------------------


def _mlflow():
    deploy = _one("Deployment")
    svc = _one("Service")
    pod = deploy["spec"]["template"]
    return deploy, svc, pod, pod["spec"]["containers"][0]


def test_mlflow_service_port_matches_container_port():
    _, svc, _, container = _mlflow()
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    container_port = next(iter(ports.values()))
    svc_port = svc["spec"]["ports"][0]
    target = svc_port.get("targetPort", svc_port["port"])
    target = ports.get(target) if isinstance(target, str) else target
    assert target == container_port, (
        f"Service targetPort resolves to {target}, container listens on {container_port}"
    )
    assert svc_port["port"] == container_port


def test_mlflow_server_listens_where_the_pod_says():
    _, _, _, container = _mlflow()
    argv = container.get("command", []) + container.get("args", [])
    assert argv[:2] == ["mlflow", "server"], argv
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert int(argv[argv.index("--port") + 1]) == container["ports"][0]["containerPort"]
    assert "--serve-artifacts" in argv


def test_mlflow_service_selects_the_pod():
    deploy, svc, pod, _ = _mlflow()
    labels = pod["metadata"]["labels"]
    selector = svc["spec"]["selector"]
    assert selector and selector.items() <= labels.items(), (selector, labels)
    match = deploy["spec"]["selector"]["matchLabels"]
    assert match.items() <= labels.items(), (match, labels)


def test_mlflow_state_lives_on_the_claimed_volume():
    deploy, _, pod, container = _mlflow()
    claims = {p["metadata"]["name"] for p in _of_kind("PersistentVolumeClaim")}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}

    argv = container.get("command", []) + container.get("args", [])
    db = argv[argv.index("--backend-store-uri") + 1]
    assert db.startswith("sqlite:////"), db
    paths = [db.removeprefix("sqlite:///"), argv[argv.index("--artifacts-destination") + 1]]
    for path in paths:
        mount = next((m for m in mounts if path.startswith(m.rstrip("/") + "/")), None)
        assert mount, f"{path} is not under any volumeMount {sorted(mounts)}"
        claim = volumes[mounts[mount]].get("persistentVolumeClaim", {}).get("claimName")
        assert claim in claims, f"{path} is on volume {mounts[mount]}, not on a PVC from infra/"

    # SQLite on a ReadWriteOnce volume: one writer, and the old pod must go before the new one starts.
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
