"""Measurements and profiles kept on disk, so that planning a model again costs nothing.

A planner runs in a fresh process for every submit (the planner actor), and a sweep, a restart or
a re-plan at another world size asks for the same model again: what took seconds to measure or
profile is read back. An entry is one file per key, named by this host and torch version (a
measurement of one machine means nothing on another); writes go to a temp file renamed into place,
so a planner in another process never reads half a file. One process at a time makes an entry: a
second planner on the host (a sweep's next cell, another run's planner actor) waits for it and reads
it, instead of measuring the same thing beside the first, which costs the time twice and skews the
timings of both.
"""

import fcntl
import json
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Codec:
    suffix: str
    dumps: Callable[[Any], bytes]
    loads: Callable[[bytes], Any]


JSON = Codec(".json", lambda value: json.dumps(value).encode(), json.loads)
# for the planner's own dataclasses (a model profile): the cache directory is the user's own, as the code is
PICKLE = Codec(".pkl", pickle.dumps, pickle.loads)


def cache_dir() -> Path:
    return Path(os.environ.get("OSDP_CACHE_DIR", Path.home() / ".cache" / "osdp-platform"))


def cache_file(kind: str, key: str, codec: Codec) -> Path:
    """Where an entry of this host and torch version is kept (`key` names what else it depends on)."""
    return cache_dir() / f"{kind}-{socket.gethostname()}-torch{torch.__version__}-{key}{codec.suffix}"


def cached(
    kind: str, key: str, make: Callable[[], Any], codec: Codec = JSON, keep: Callable[[Any], bool] = lambda _: True
) -> Any:
    """The stored entry of this kind and key, or a new one made and stored if `keep` says it may stand for
    later plans (a measurement taken on a busy host is used once and made again next time)."""
    path = cache_file(kind, key, codec)
    if path.is_file():
        return codec.loads(path.read_bytes())
    lock_file = path.parent / "locks" / f"{path.name}.lock"  # beside the entries, not among them
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed maker's process ends
        if path.is_file():  # made by the process this one waited for
            return codec.loads(path.read_bytes())
        result = make()
        if not keep(result):
            return result
        with tempfile.NamedTemporaryFile("wb", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            tmp.write(codec.dumps(result))
        os.replace(tmp.name, path)
    return result
