"""Files written so that a crash never leaves half of one, checksums, and one-line error text.

Everything here is standard library only: the checking layer (cli, compose, config, run-dir checks)
uses it before torch is imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any


def new_file_mode() -> int:
    """The permissions a plain new file gets under this process's umask: what write_atomic's
    `mode` should be for a file the user reads (mkstemp makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False, mode: int | None = None) -> None:
    """Write `data` to `path` through a temporary file in the same folder and one rename: a reader
    sees the old file or the new one, never a torn one. `durable` also fsyncs the file and the
    folder (for files a resume depends on). `mode` sets the permission bits (mkstemp makes 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_durable(path: Path, text: str) -> None:
    """Write a new file in place and fsync it (inside a folder that is published by a rename later)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable; a no-op where that is unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def one_line(text) -> str:
    """Any text (an exception's message, a file's content) folded onto one line."""
    return " ".join(str(text).split())


def first_line(err: BaseException) -> str:
    """`ErrorType: the first line of its message`, for errors that wrap another one."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".strip()


def dotted_keys(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys ({"model": {"n_layer": 2}} -> {"model.n_layer": 2}):
    the keys DCP stores a nested state under, and a config's keys as the run record and MLflow's
    parameters name them."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(dotted_keys(value, name + "."))
        else:
            out[name] = value
    return out


def flock_held(path: Path) -> bool:
    """Some process holds a flock on `path` (a folder a live run or sweep holds: rundir.RunDirLock),
    which the OS releases when it dies, kill -9 included. Probed by taking a shared lock and closing
    it at once, which writes nothing and also sees a holder on another node of a shared file system."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without flock: no run could have held it either
    finally:
        os.close(fd)  # lets go of the probe's own lock
    return False


def flock_holder(path: Path) -> int | None:
    """The pid holding a flock on `path` (a file or folder), from /proc/locks (Linux), or None."""
    try:
        st = os.stat(path)
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                return int(fields[4])
    except (OSError, ValueError):
        pass
    return None
