"""The one line a worker leaves for its driver, in torchelastic's error file.

torchelastic gives each worker a file (TORCHELASTIC_ERROR_FILE) that its agent reads back when the
worker fails (the failure's `error_file_data`; the earliest timestamp is reported as the first
failure). dtrain writes its one-line errors there under USER_ERROR_KEY and the worker exits with
USER_ERROR_EXIT; the driver (trainer/launch/workers.py) raises them as the user's one `error:` line.
A user error on the way out (trainer/launch/worker_errors.py) and a hang's report
(trainer/process/hang_watch.py) both leave this way.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

USER_ERROR_KEY = "dtrain_user_error"
USER_ERROR_EXIT = 2  # as the `dtrain` command's own exit code for a user error
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def write_error_record(kind: str, line: str, timestamp: float | None = None) -> bool:
    """Record `line` for the driver (torchelastic's layout of the file, the line beside it); False
    where torchelastic gave this worker no error file. `timestamp`: when the failure began (now by
    default), which decides whose failure the agent reports first."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return False
    record = {
        "message": {"message": f"{kind}: {line}",
                    "extraInfo": {"py_callstack": "", "timestamp": str(int(timestamp or time.time()))}},
        USER_ERROR_KEY: line,
    }
    Path(error_file).write_text(json.dumps(record))
    return True
