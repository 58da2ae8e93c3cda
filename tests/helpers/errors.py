"""The one-line rule as the tests assert it: exit code 2, one `error:` line, no traceback, nothing
written."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.dtrain import REPO


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error of a failed dtrain: exit code 2, one `error:` line, no traceback."""
    assert proc.returncode == 2, f"exit code {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def assert_user_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), err
    assert len([line for line in lines if line.startswith("error:")]) == 1
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def error_line(proc) -> str:
    """The one `error:` line a refused command ends with (asserting the rule on the way)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), out
    assert sum(line.startswith("error:") for line in lines) == 1, out
    return lines[-1]


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def default_run_dirs() -> set[Path]:
    return {log.parent for log in (REPO / "outputs").rglob("dtrain.log")}


# The user's own runs there (`make train` writes into outputs/) are not this suite's doing.
DEFAULT_RUN_DIRS_BEFORE = default_run_dirs()


def assert_nothing_written(run_dir: Path) -> None:
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    assert default_run_dirs() <= DEFAULT_RUN_DIRS_BEFORE, "a default run dir"
