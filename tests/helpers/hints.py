"""Every hint dtrain prints runs as printed (issue 45 item 10): take the backticked `dtrain ...`
command out of an error or notice line and run it as the user would paste it into a shell."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from helpers.dtrain import run_dtrain

BACKTICKED = re.compile(r"`(dtrain [^`]+)`")


def hint_command(text: str) -> list[str]:
    """The argv (after `dtrain`) of the one backticked `dtrain ...` command in `text`, split as a
    shell splits it (the hint is printed shell-quoted, e.g. 'data.source=code/*.py')."""
    found = BACKTICKED.findall(text)
    assert len(found) == 1, f"expected one `dtrain ...` hint in: {text!r}"
    return shlex.split(found[0])[1:]


def run_hint(text: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the hint in `text` as printed, from `cwd` (the folder the refused command ran in: a hint may
    name relative paths) and with its environment (DTRAIN_DATA_DIR, when the data.dir came from it);
    asserts it succeeds."""
    return run_dtrain(hint_command(text), cwd=cwd, check=True, env=env)
