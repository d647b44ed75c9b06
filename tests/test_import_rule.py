"""The one-way rule: what runs in a Ray worker never imports the driver's side, so a worker loads
neither MLflow nor Ray's Jobs client (each costs every worker seconds of start-up on a small node)."""

import subprocess
import sys

DRIVER_ONLY = ("mlflow", "ray.job_submission", "osdp_platform.tracking", "osdp_platform.submit")


def test_the_worker_loop_loads_no_driver_module() -> None:
    code = f"import sys, osdp_platform.worker\nprint(sorted(m for m in {DRIVER_ONLY!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "[]", done.stdout
