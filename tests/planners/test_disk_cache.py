"""The planner's disk cache across processes: an entry is made once per host, whoever asks first."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
