"""Measurements that need the workers' conditions: N gloo processes on this host.

A CPU pool's workers are processes that share this host's cores, so one process timed alone runs
faster than each of them will. Probes therefore run as `world` concurrent single-threaded ranks,
started as plain subprocesses (multiprocessing's spawn would re-import the caller's __main__).
"""

import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from osdp_planners.cpu_wait import WaitMeter
from osdp_planners.errors import UserError

TIMEOUT_S = 300
log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: str, world: int, args: list[str]) -> dict[str, Any]:
    """Run `target` ("module:function", see rank_main) as `world` ranks; returns what rank 0 wrote.

    Started with `python -c`, not `-m module`: runpy warns when the package has already imported the
    module it is asked to run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        port = str(_free_port())
        # the caller's import path, so a model defined in the caller's modules unpickles there too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        entry = "from osdp_planners.local_ranks import rank_main; rank_main()"
        errs = [Path(tmp) / f"rank{rank}.err" for rank in range(world)]
        procs = []
        for rank, err in enumerate(errs):
            with err.open("w") as stderr:  # the child keeps its own handle
                argv = [sys.executable, "-c", entry, target, str(rank), str(world), port, str(out), *args]
                procs.append(subprocess.Popen(argv, cwd=tmp, env=env, stderr=stderr))
        try:
            codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise UserError(
                "hardware.workers_per_node",
                world,
                f"the planner's probe of {world} concurrent ranks on this host ({os.cpu_count()} cores) did not "
                f"finish in {TIMEOUT_S} s: the host is oversubscribed or a rank hung",
                "run fewer workers per node (at most a few per core), or on a host with more cores",
            ) from None
        # rank 0 writes OUT only after every rank's last collective: a peer that fails after that (gloo
        # has aborted a rank in teardown, exit -6, once in a CI run) measured all the same
        if codes[0] != 0 or not out.is_file():
            raise UserError(
                "hardware.workers_per_node",
                world,
                f"the planner's probe of {world} concurrent ranks on this host ({target}) failed (exit codes "
                f"{codes}){_why(errs, codes)}",
                "the rank's error after the exit codes names the cause: in the model's own code, see the "
                "README's 'Your own model'; otherwise another number of workers per node may plan, and this "
                "message is one for the platform's maintainers",
            )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def pin_to_core(index: int, peers: int) -> None:
    """Hold a CPU worker on one core of its own, as a pool's worker holds one CPU.

    Unpinned, the scheduler moves a rank and its gloo threads between cores while its peers wait at
    the next collective: on a 2-core host the DP overhead probe varied 17-48 ms over four runs
    unpinned, 14-19 ms in three of four pinned. Skipped where there are fewer cores than workers
    (or no affinity API).
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if peers <= len(cores):
        os.sched_setaffinity(0, {cores[index]})


def _why(errs: list[Path], codes: list[int]) -> str:
    """The last line the first rank to fail wrote to stderr (where Python and torch put the error; the
    others then fail at their next collective, their peer gone), for the message. Every rank's whole
    stderr goes to this module's logger at debug level: `plan` probes in the CLI's own process, and a
    user's mistake is one message, not a page of tracebacks."""
    texts = [err.read_text(errors="replace") for err in errs]
    for rank, text in enumerate(texts):
        log.debug("rank %d of the probe wrote:\n%s", rank, text)
    failed = [rank for rank, code in enumerate(codes) if code != 0] or list(range(len(errs)))
    for rank in sorted(failed, key=lambda r: errs[r].stat().st_mtime_ns):
        lines = [line.strip() for line in texts[rank].splitlines() if line.strip()]
        if lines:
            return f": {lines[-1][:300]}"
    return ""


def rank_main() -> None:
    """Entry point of one rank (argv: target rank world port out *args): join the gloo group, run the
    target `function(rank, world, args)`, rank 0 writes its result to `out`."""
    target, rank, world, port, out, *args = sys.argv[1:]
    module, name = target.split(":")
    body: Callable[[int, int, list[str]], dict[str, Any] | None] = getattr(importlib.import_module(module), name)
    torch.set_num_threads(1)  # as a worker holding one CPU of the pool
    pin_to_core(int(rank), int(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world))
    result = body(int(rank), int(world), args)
    if int(rank) == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: torch's and gloo's threads need not be unwound in order


def slowest(seconds: list[float]) -> list[float]:
    """Each duration as the slowest rank took it: a step ends when its last rank does, and that is
    what the runtime reports as step time."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def busiest_wait(meter: WaitMeter, ranks: int) -> float | None:
    """The largest share of its time any rank waited for a CPU beyond what the ranks cause each other
    (cpu_wait); None where the kernel does not say."""
    share = meter.share(ranks)
    busiest = slowest([-1.0 if share is None else share])[0]
    return None if busiest < 0 else busiest
