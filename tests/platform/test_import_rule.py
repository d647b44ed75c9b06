"""The one-way rule (osdp_platform's docstring): what runs in a Ray worker never imports the driver or
tracking, so a worker loads neither MLflow nor Ray's Jobs client (each costs every worker seconds of
start-up on a small node)."""

import subprocess
import sys

COST_MODEL = ("osdp_planners.evaluate", "osdp_planners.time_model", "osdp_planners.memory_model")
FORBIDDEN = ("mlflow", "ray.job_submission", "osdp_platform.driver", "osdp_platform.tracking")


def test_the_worker_loop_loads_no_driver_or_tracking_module() -> None:
    code = (
        "import sys, osdp_platform.runtime.worker\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow' or m.startswith({FORBIDDEN!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_report_draws_the_explanation_without_the_cost_model() -> None:
    """One contract out of the planner: the platform's charts read the plan and its explanation only."""
    code = f"import sys, osdp_platform.tracking.report\nprint(sorted(m for m in sys.modules if m in {COST_MODEL!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_side_actors_start_without_torch() -> None:
    """The inbox and the node samplers are processes of every run: importing torch would cost each seconds."""
    code = "import sys, osdp_platform.runtime.inbox, osdp_platform.driver.system_metrics\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "False", done.stdout
