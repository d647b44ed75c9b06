"""Shared fixtures: one real local Ray and one real MLflow server for the session, a temp working folder."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from helpers import TEST_PATH, MlflowServer

# Ray Train's controller takes a worker's report (and with it a checkpoint) from a queue of one, polling
# every 2 s by default: a run that checkpoints every 2 steps waited about 2 s per checkpoint, and a
# worker's death was noticed up to 2 s late. The driver hands this on to every controller and worker; CLI
# subprocesses and the fake clusters' heads inherit it (ray_head.client_env).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# The planner's probes time models here under the suite's load (two test workers, each with its Ray), so
# its measurements are slow; kept apart from the user's cache, they never slow `make run`'s predictions
# (the tiny recipe's, 2.4x). Subprocesses and the Ray workers this process starts inherit it.
os.environ.setdefault("OSDP_CACHE_DIR", str(Path.home() / ".cache" / "osdp-platform-tests"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy modules first: `make test` hands whole files to its xdist workers as they free up, and a
    long file handed out last would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A real local Ray (no dashboard), 4 logical CPUs so 4 gloo workers fit on 2 cores."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": TEST_PATH}},  # workers unpickle loops defined in test modules
    )
    yield
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temp folder so runs/ and mlflow.db never land in the repo."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()
