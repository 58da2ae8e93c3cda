"""Files written so that a crash never leaves half of one, checksums, one-line error text, and the
folders dtrain is about to write into (a run directory, an export folder, data.dir): refused up front
when they cannot be written, and a write into one that fails for want of space or permission
reported as one line instead of a traceback.

Everything here is standard library only: the checking layer (cli, compose, config, run-dir checks)
uses it before torch is imported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from trainer.errors import UserError


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


def write_durable(path: Path, text: str | bytes) -> None:
    """Write a new file in place and fsync it (inside a folder that is published by a rename later)."""
    with open(path, "wb" if isinstance(text, bytes) else "w") as f:
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

# Less free space than this where a run starts is a full disk: Hydra's .hydra/*.yaml, dtrain.log,
# resolved_config.json and the first metrics lines alone take tens of kilobytes.
MIN_FREE_BYTES = 1 << 20
# The errors of a write that the user fixes (space, permissions, a read-only mount), not dtrain.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# A file takes whole blocks of the file system (4 KiB on ext4, xfs and tmpfs), and its temporary
# copy's name an entry more: what a room check adds per file.
BLOCK_BYTES = 4096


def folder_setting(key: str, value) -> Path:
    """The folder a setting names (e.g. hydra.run.dir), absolute; refused when empty (that would be
    the current folder: a run would write among the user's own files) or when a name on it is
    longer than the file system takes. Touches nothing on disk beyond asking for the limits."""
    if value is None or not str(value).strip():
        raise UserError(f"{key}= is empty; name a folder for the outputs, e.g. {key}=outputs/NAME")
    path = Path(str(value)).expanduser().absolute()
    check_name_lengths(path, key, f"choose a shorter {key}=")
    return path


def check_name_lengths(path: Path, what: str, fix: str) -> None:
    """Each name on the path within the file system's limit (NAME_MAX, 255 bytes on Linux) and the
    whole path within PATH_MAX: a longer one fails in the middle of making it (ENAMETOOLONG)."""
    path = Path(path).absolute()
    name_max = os.pathconf(path.anchor or "/", "PC_NAME_MAX")
    long = next((name for name in path.parts if len(os.fsencode(name)) > name_max), None)
    if long is not None:
        shown = long if len(long) <= 40 else f"{long[:37]}..."
        raise UserError(f"{what}: the name {shown} has {len(os.fsencode(long))} bytes, more than the file "
                        f"system's {name_max}; {fix}")
    path_max = os.pathconf(path.anchor or "/", "PC_PATH_MAX")
    if len(os.fsencode(str(path))) >= path_max:
        raise UserError(f"{what}: the path has {len(os.fsencode(str(path)))} bytes, more than the file "
                        f"system's {path_max - 1}; {fix}")


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its closest existing ancestor (what mkdir would write into)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():
            raise UserError(f"{probe} is a broken symbolic link; remove it or point it at a folder")
        probe = probe.parent
    return probe


def not_a_folder(path: Path) -> str:
    """Why `path` is no folder, for an error line: a file where a folder is expected says so."""
    return "is a file, not a folder" if Path(path).exists() else "does not exist"


def check_writable_dir(path: Path, what: str, fix: str) -> None:
    """Refuse a folder that cannot be made and written, before anything is written: a file where a
    folder is needed (the path itself or a parent), a nearest existing folder that refuses writes
    (permissions, an immutable folder, a read-only mount), a name too long, or a full disk. `what` names the setting
    (e.g. "hydra.run.dir=/x/run"), `fix` how to choose another (e.g. "choose another hydra.run.dir=")."""
    check_name_lengths(path, what, fix)
    probe = nearest_existing(path)
    if not probe.is_dir():
        raise UserError(f"{what}: {probe} is a file, not a folder; {fix}")
    # os.access, not a probe file: nothing is written. It refuses root too for an immutable folder
    # (chattr +i) and for a read-only mount, where root's permission override does not apply.
    if not os.access(probe, os.W_OK | os.X_OK):
        stat = os.statvfs(probe)
        reason = "a read-only file system" if stat.f_flag & os.ST_RDONLY else "no write permission, or immutable"
        raise UserError(f"{what}: the folder {probe} cannot be written ({reason}); {fix}")
    free = _free_bytes(probe)
    if free < MIN_FREE_BYTES:
        raise UserError(f"{what}: the disk holding {probe} is full ({free:,} bytes free); free space there or {fix}")


def check_room(folder: Path, sizes: Iterable[int], what: str, fix: str) -> None:
    """Refuse, before anything is written, files of `sizes` bytes that the disk holding `folder`
    cannot take (each rounded up to a block, as a file system stores it). `what` names them (e.g.
    "the export"), `fix` how to choose another folder."""
    sizes = list(sizes)
    need = sum(-(-size // BLOCK_BYTES) * BLOCK_BYTES for size in sizes) + BLOCK_BYTES * len(sizes)
    free = _free_bytes(nearest_existing(folder))
    if free < need:
        raise UserError(f"no space left on the disk holding {folder} for {what}: it needs {need:,} bytes, "
                        f"{free:,} are free; free space there or {fix}")


def _free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


@contextlib.contextmanager
def write_errors_as_user_errors(folder: Path, fix: str) -> Iterator[None]:
    """A write into `folder` inside this block that fails for want of space or permission (ENOSPC,
    EDQUOT, EROFS, EACCES, EPERM) becomes one UserError line naming the folder and `fix`; the part
    of `folder` that this block created is removed again, so a failed start leaves nothing behind.
    Other errors pass through unchanged."""
    folder = Path(folder).absolute()
    created = first_missing(folder)
    try:
        yield
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        target = f" ({err.filename})" if err.filename else ""
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"no space left on the disk holding {folder}{target}; free space there or {fix}") from None
        raise UserError(f"cannot write into {folder}{target}: {err.strerror}; {fix}") from None


def first_missing(folder: Path) -> Path | None:
    """The outermost folder on the way to `folder` that does not exist yet (None if it exists)."""
    missing = None
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing, probe = probe, probe.parent
    return missing
