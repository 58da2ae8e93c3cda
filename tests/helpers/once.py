"""Made once per test session, whichever pytest-xdist worker asks first: the prepared corpus and the
runs several modules check. Each worker is its own process with its own session fixtures, so
without this every worker that met a module asking for a run trained it again (the modes' parity
runs, the checkpointed references: both cores training the same runs twice)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def session_folder(tmp_path_factory) -> Path:
    """A folder every worker of this pytest run shares: under xdist each worker's base temp is a
    child (popen-gw0, popen-gw1 ...) of the run's own, which holds nothing else of another run."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "made_once"
    shared.mkdir(exist_ok=True)
    return shared


def made_once(folder: Path, make: Callable[[Path], None]) -> Path:
    """`folder`, filled by `make(folder)` unless a worker already did: the first to take the
    folder's lock makes it while the others wait, and a make that failed (no `.done` beside it) is
    made again from scratch by the next to ask, which then fails the same way with its own output."""
    done = folder.with_name(folder.name + ".done")
    if done.exists():
        return folder
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a worker dies
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
            done.touch()
    return folder


def folder_name(*args: str) -> str:
    """A short stable name for a run's arguments (the same in every worker)."""
    return "run_" + hashlib.sha256("\0".join(args).encode()).hexdigest()[:16]
