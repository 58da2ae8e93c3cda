"""A dataset folder in use by a live run cannot be re-prepared under it.

A run holds a shared flock on the dataset folder for its whole life; a prepare that would rewrite
the folder takes the exclusive one without waiting, and refuses when a run holds it. flock on the
folder itself: taking it writes nothing, and the OS releases it when the holder dies (kill -9
included), so a dead run never blocks a prepare.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from trainer.errors import DataError
from trainer.io import flock_holder


def _flock(folder: Path, how: int) -> int | None:
    """An open descriptor of `folder` holding flock `how` (non-blocking), or None when it is held."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _holder(folder: Path) -> str:
    pid = flock_holder(folder)
    return f" (pid {pid})" if pid else ""


def hold_for_reading(folder: Path) -> int:
    """Take the shared lock a run holds on its dataset folder; returns the descriptor (closing it
    releases the lock). Refused while a prepare rewrites the folder."""
    fd = _flock(folder, fcntl.LOCK_SH)
    if fd is None:
        raise DataError(f"dataset folder {folder} is being prepared{_holder(folder)}; wait for that "
                        "`dtrain prepare` to end, then run this command again")
    return fd


@contextlib.contextmanager
def rewriting(folder: Path, fix: str) -> Iterator[None]:
    """Hold the exclusive lock on a dataset folder while it is rewritten; a DataError naming `fix`
    when a live run is reading it."""
    fd = _flock(folder, fcntl.LOCK_EX)
    if fd is None:
        raise DataError(f"dataset folder {folder} is in use by a running dtrain run{_holder(folder)}: "
                        f"re-preparing it would change the tokens under it; wait for the run to end, or {fix}")
    try:
        yield
    finally:
        os.close(fd)
