"""Shared fixtures: one real local Ray and one real MLflow server for the session, a temp working folder."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from helpers import TEST_PATH, MlflowServer


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
