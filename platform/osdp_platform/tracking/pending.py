"""Writes for an MLflow run that could not reach its tracking server, kept on local disk until it can.

One folder per run: `run.json` (tracking URI and run id, so any later process can upload),
`writes.jsonl` (metrics, tags, artifacts and the end of the run, one write a line, in the order
they were made) and `files/` (artifact files). A write leaves the file only once it is uploaded, so
an upload that fails halfway resumes where it stopped and sends nothing twice.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Write = dict[str, Any]  # {"kind": "metrics" | "tags" | "text" | "file" | "end", ...} (see tracking/runs.py)

WRITES = "writes.jsonl"
RUN = "run.json"


@dataclass(frozen=True)
class PendingWrites:
    folder: Path

    @classmethod
    def create(cls, folder: Path, uri: str, run_id: str) -> "PendingWrites":
        (folder / "files").mkdir(parents=True, exist_ok=True)
        (folder / RUN).write_text(json.dumps({"uri": uri, "run_id": run_id}))
        return cls(folder)

    def run(self) -> tuple[str, str]:
        """(tracking URI, run id) of the run these writes belong to."""
        data = json.loads((self.folder / RUN).read_text())
        return data["uri"], data["run_id"]

    def append(self, write: Write) -> None:
        with (self.folder / WRITES).open("a") as f:
            f.write(json.dumps(write) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def keep_file(self, path: Path) -> str:
        """Copy an artifact file in under its own name (the caller's copy may be temporary); returns its path here."""
        folder = self.folder / "files" / f"{len(list((self.folder / 'files').iterdir())):04d}"
        folder.mkdir()
        shutil.copyfile(path, folder / path.name)
        return str((folder / path.name).relative_to(self.folder))

    def writes(self) -> list[Write]:
        path = self.folder / WRITES
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def drop_first(self, count: int) -> None:
        """Forget the first `count` writes (uploaded); atomic, so a crash keeps all or none of them."""
        rest = self.writes()[count:]
        tmp = self.folder / f"{WRITES}.tmp"
        tmp.write_text("".join(json.dumps(w) + "\n" for w in rest))
        tmp.replace(self.folder / WRITES)

    def remove(self) -> None:
        shutil.rmtree(self.folder)
        parent = self.folder.parent
        if parent.exists() and not any(parent.iterdir()):
            parent.rmdir()
