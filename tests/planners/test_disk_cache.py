"""The planner's disk cache: an entry is made once per host, whoever asks first, and kept only if quiet."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from osdp_planners.cpu_wait import BUSY_SHARE, quiet
from osdp_planners.disk_cache import cached

# A planner in its own process: once imported it says READY and waits for `go`, then asks for one entry
# whose making takes a while and leaves a line in `made` each time it runs.
ASK = """
import json, sys, time
from pathlib import Path
from osdp_planners.disk_cache import cached

made, go = Path(sys.argv[1]), Path(sys.argv[2])
print("READY", flush=True)
while not go.exists():
    time.sleep(0.01)

def make():
    with made.open("a") as f:
        f.write("made\\n")
    time.sleep(1.5)
    return {"value": 42}

print("RESULT" + json.dumps(cached("probe-v1", "w2", make)))
"""


def test_two_planners_asking_at_once_make_the_entry_once(tmp_path: Path) -> None:
    made, go = tmp_path / "made", tmp_path / "go"
    env = {**os.environ, "OSDP_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen([sys.executable, "-c", ASK, str(made), str(go)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for p in procs:  # both imported: they ask within milliseconds of each other, well inside one making
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    go.touch()
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = [json.loads(out.split("RESULT", 1)[1]) for out in outs]
    assert results == [{"value": 42}, {"value": 42}]
    assert made.read_text().splitlines() == ["made"], "both processes measured the same entry"


def test_an_entry_not_to_be_kept_is_returned_and_made_again_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe timed on a busy host (`quiet` says no) serves the plan that asked and is not stored."""
    monkeypatch.setenv("OSDP_CACHE_DIR", str(tmp_path))
    made: list[dict[str, float]] = []

    def make(wait: float) -> dict[str, float]:
        made.append({"cpu_wait_share": wait})
        return made[-1]

    assert cached("model-v1", "k", lambda: make(BUSY_SHARE + 0.1), keep=quiet) == {"cpu_wait_share": BUSY_SHARE + 0.1}
    assert cached("model-v1", "k", lambda: make(0.05), keep=quiet) == {"cpu_wait_share": 0.05}
    assert cached("model-v1", "k", lambda: make(0.0), keep=quiet) == {"cpu_wait_share": 0.05}, "read back"
    assert len(made) == 2
