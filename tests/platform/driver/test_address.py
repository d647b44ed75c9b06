"""A ray:// or HOST:PORT address no Ray answers at is the user's to fix: exit 2 with one message naming
--address, before anything starts, and none of Ray's own warnings on the terminal."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import RECIPES, free_port
from osdp_platform.driver.cli import EXIT_USER_ERROR


def _submit(address: str, folder: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The CLI in a process of its own: the test session may hold a Ray already, and connect would reuse it."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RAY_ADDRESS")}
    store = f"tracking.uri=sqlite:///{folder / 'm.db'}"
    cli = [sys.executable, "-m", "osdp_platform.driver.cli", "submit", str(RECIPES / "tiny.yaml"), store]
    result = subprocess.run(
        [*cli, "--address", address],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=180,
        env=base | (env or {}),
    )
    return result.returncode, result.stdout + result.stderr


def _refused_as_address(code: int, output: str, address: str, what: str = "client server") -> None:
    assert code == EXIT_USER_ERROR, output[-3000:]
    assert f"--address = '{address}': no Ray {what} answers there" in output and "fix:" in output
    assert "Warning" not in output and "warnings.warn" not in output and "Traceback" not in output, output


def test_a_closed_port_is_refused_at_once(tmp_path: Path) -> None:
    address = f"ray://127.0.0.1:{free_port()}"
    start = time.monotonic()
    code, output = _submit(address, tmp_path)
    _refused_as_address(code, output, address)
    assert time.monotonic() - start < 25  # Ray's client alone retries for about 30 s
    assert not (tmp_path / "m.db").exists()


def test_a_port_that_is_no_ray_client_server_is_refused(tmp_path: Path) -> None:
    """Something listens but never answers gRPC: Ray's client gives up (its timeouts cut to 1 s here), and
    its ConnectionError and its warning become the one message."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"ray://127.0.0.1:{server.getsockname()[1]}"
        quick = {"RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1", "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "1"}
        code, output = _submit(address, tmp_path, quick)
    _refused_as_address(code, output, address)


def test_a_head_address_nothing_answers_at_is_refused_at_once(tmp_path: Path) -> None:
    """HOST:PORT, as a driver inside the cluster joins the head's GCS: Ray waited minutes, silent."""
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    code, output = _submit(address, tmp_path)
    _refused_as_address(code, output, address, "head (its GCS port)")
    assert time.monotonic() - start < 25
