"""Without --verbose, what Ray's workers print (their logs, torch's FutureWarnings) stays off the terminal."""

import os
import subprocess
import sys
from pathlib import Path

from helpers import RECIPES

SCRIPT = f"""
import sys, warnings
import ray
from osdp_platform.driver.cli import _quiet
from osdp_platform.driver.cluster import connect
from osdp_platform.recipe.loader import load_recipe

@ray.remote(num_cpus=0)
def noisy():
    print("osdp-marker-printed", file=sys.stderr)
    warnings.warn("osdp-marker-warned", FutureWarning)
    return "ran"

_quiet()
connect(load_recipe("{RECIPES / "tiny.yaml"}"), None, verbose=False)
assert ray.get(noisy.remote()) == "ran"
import time; time.sleep(3)  # Ray forwards worker output about once a second
ray.shutdown()
print("done")
"""


def test_worker_output_stays_off_the_terminal_unless_verbose(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RAY_ADDRESS")}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "osdp-marker" not in output and "Started a local Ray instance" not in output, output[-3000:]
