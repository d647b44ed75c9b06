"""Submit to a remote Ray cluster through its Jobs API (`--address http://HEAD:8265`).

The client ships the project folder (the current directory) to the head as the job's working
directory and runs the same `osdp-platform submit` (or `sweep`) there as the job's driver, so
planning, training and tracking happen inside the cluster exactly as for a local run. The client only streams the job's
logs and returns its exit status: 0, 2 for a mistake the job reports as a user error, 1 otherwise.
The run belongs to the cluster: Ctrl-C, or a laptop that goes away, stops following the job, not the job.
"""

import asyncio
import shlex
import sys
import time
import uuid
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient
from rich.console import Console

from osdp_planners.errors import UserError

JOBS_API_SCHEMES = ("http://", "https://")
STATUS_POLLS = 30
# Never shipped: environments, local runs and tracking stores, caches (the project's .gitignore
# is applied as well, by Ray).
WORKING_DIR_EXCLUDES = [
    ".venv/",
    ".git/",
    "runs/",
    "mlruns/",
    "mlartifacts/",
    "mlflow.db",
    "__pycache__/",
    ".pytest_cache/",
    ".ruff_cache/",
    "*.egg-info/",
]


def is_jobs_api(address: str) -> bool:
    """An http(s) address is a Ray dashboard (Jobs API); anything else is for `ray.init`."""
    return address.startswith(JOBS_API_SCHEMES)


def job_entrypoint(command: str, recipe_path: str, args: list[str], project: Path) -> str:
    """The driver command the head runs: the same command, with the recipe relative to the shipped project."""
    path = Path(recipe_path).resolve()
    if not path.is_relative_to(project.resolve()):
        raise UserError(
            "recipe",
            recipe_path,
            f"is outside the project folder {project} that is shipped to the cluster as the job's working directory",
            "run the command from a folder that contains the recipe (and any file it refers to)",
        )
    return shlex.join(["osdp-platform", command, path.relative_to(project.resolve()).as_posix(), *args])


def _client(address: str) -> JobSubmissionClient:
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(
            "--address",
            address,
            f"no Ray Jobs API answers there ({str(exc).splitlines()[0]})",
            "give the head's dashboard address (port 8265; on Kubernetes `kubectl port-forward svc/<cluster>-head-svc "
            "8265:8265` and --address http://127.0.0.1:8265), or ray://HEAD:10001 for a Ray client",
        ) from None


async def _follow(client: JobSubmissionClient, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def submit_job(name: str, command: str, recipe_path: str, args: list[str], address: str, console: Console) -> int:
    """Run `command` (submit, sweep) on `recipe_path` with `args` (overrides, options) as a job on the cluster
    at `address`, stream its logs, and return its exit status. `name` (the recipe's) names the job."""
    project = Path.cwd()
    entrypoint = job_entrypoint(command, recipe_path, args, project)
    client = _client(address)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        submission_id=f"osdp-{name}-{uuid.uuid4().hex[:8]}",
        runtime_env={"working_dir": str(project), "excludes": WORKING_DIR_EXCLUDES},
    )
    console.print(f"submitted job {job_id} to {address}: {entrypoint}", markup=False)
    try:
        asyncio.run(_follow(client, job_id))
    except KeyboardInterrupt:
        console.print(
            f"stopped following; the job goes on. Follow it: ray job logs -f {job_id} --address {address}; "
            f"stop it: ray job stop {job_id} --address {address}",
            markup=False,
        )
        return 130
    info = client.get_job_info(job_id)
    for _ in range(STATUS_POLLS):  # the log stream can close a moment before the status turns final
        if info.status.is_terminal():
            break
        time.sleep(1)
        info = client.get_job_info(job_id)
    if info.status == JobStatus.SUCCEEDED:
        return 0
    console.print(f"job {job_id} {info.status}: {info.message}", markup=False)
    code = info.driver_exit_code
    return code if code is not None and code > 0 else 1
