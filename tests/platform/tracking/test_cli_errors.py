"""`sync` and `compare` refuse a user's mistake with one message naming the argument (exit 2), and
`compare` (read-only) never creates a tracking store."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from osdp_platform.driver.cli import EXIT_USER_ERROR, main


def test_sync_of_a_missing_folder_names_it_and_what_sync_expects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "nope"
    assert main(["sync", str(folder)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"FOLDER = '{folder}'" in err and "run.json" in err and "fix:" in err
    assert "Error" not in err  # no raw Python exception text
    assert not folder.exists()


def test_compare_of_a_missing_store_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "nonexist.db"
    uri = f"sqlite:///{db}"
    assert main(["compare", "--experiment", "osdp-tiny", "--uri", uri]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"--uri = '{uri}'" in err and "no tracking store at" in err and "fix:" in err
    assert not db.exists()


def test_compare_asks_for_run_ids_or_an_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    MlflowClient(uri).create_experiment("empty")
    assert main(["compare", "--uri", uri]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "run ids" in err and "--experiment" in err and "None: no such experiment" not in err
    # an existing store passes the checks: its empty experiment is what is refused
    assert main(["compare", "--uri", uri, "--experiment", "empty"]) == EXIT_USER_ERROR
    assert "holds no plan or train runs" in capsys.readouterr().err


def test_a_refused_uri_is_named_as_the_option_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(A server that does not answer: tests/integration/test_tracking.py.)"""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = "file:///tmp"
    assert main(["compare", "--uri", uri, "--experiment", "x"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: --uri = '{uri}'") and "tracking.uri" not in err
