"""The run's log file, `dtrain.log` in its run directory, written through Python's `logging`.

Hydra's job logging (conf/hydra/job_logging/dtrain.yaml) gives the process that runs the job a
file handler on the root logger; rank 0 of a one-process run trains in that process, so its records
reach the file through that handler. Workers that dtrain's launcher starts are other processes:
the launcher passes the file's path in their environment and rank 0 appends there with a handler
of its own, added only where no handler of its process writes that file already (so no line is
written twice). `hydra/job_logging=disabled` leaves no file handler, and then no worker writes one.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from trainer.process.streams import when_a_reader_leaves

LOG = logging.getLogger("dtrain")
# Set by dtrain's launcher for its workers: the driver's job log file (absent: none to write to).
JOB_LOG_ENV = "DTRAIN_JOB_LOG"
# Set by dtrain's launcher for its workers: ranks other than 0 print their own step lines, which
# go to their log files under <run dir>/logs (plain torchrun's ranks share one terminal: they don't).
RANK_LINES_ENV = "DTRAIN_RANK_LINES"
# conf/hydra/job_logging/dtrain.yaml's format, for the records a worker appends to the same file.
JOB_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def job_log_path() -> str | None:
    """The file this process's job logging writes (Hydra's handler on the root logger), if any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def worker_environment() -> dict[str, str]:
    """What the launcher tells its workers about logging (see the module docstring)."""
    env = {RANK_LINES_ENV: "1"}
    path = job_log_path()
    if path is not None:
        env[JOB_LOG_ENV] = path
    return env


def rank_lines_wanted() -> bool:
    return os.environ.get(RANK_LINES_ENV) == "1"


def _files_written() -> list[str]:
    """The files a record of LOG reaches (through propagation), nearest handler first."""
    files = []
    logger: logging.Logger | None = LOG
    while logger is not None:
        files += [h.baseFilename for h in logger.handlers if isinstance(h, logging.FileHandler)]
        logger = logger.parent if logger.propagate else None
    return files


@contextmanager
def job_log(main: bool) -> Iterator[None]:
    """While training: rank 0 in a worker of dtrain's launcher appends LOG's records to the
    driver's job log. Elsewhere (the job's own process, other ranks) it adds nothing. Rank 0 says
    once when the reader of its stdout or stderr leaves (trainer.process.streams): training goes on."""
    path = os.environ.get(JOB_LOG_ENV)
    handler = None
    level = LOG.level
    if main and path and os.path.abspath(path) not in _files_written():
        handler = logging.FileHandler(path, encoding="utf-8")  # append: the driver's handler has it open too
        handler.setFormatter(logging.Formatter(JOB_LOG_FORMAT))
        LOG.addHandler(handler)
        LOG.setLevel(logging.INFO)  # a spawned worker's root logger is at WARNING
    try:
        with when_a_reader_leaves(_going_on) if main else nullcontext():
            yield
    finally:
        if handler is not None:
            LOG.removeHandler(handler)
            LOG.setLevel(level)
            handler.close()


def say(message: str) -> None:
    """A notice from rank 0 ("dtrain: ..." on stderr), also kept in the job log (first: the log
    file is the record that stays)."""
    LOG.info(message)
    print(f"dtrain: {message}", file=sys.stderr, flush=True)


def _going_on(stream: str) -> None:
    """What rank 0 says when the reader of its `stream` left (`| head`, a pager closed, a `| tee`
    killed): the run goes on, its lines in the job log."""
    files = _files_written()
    kept = f"its lines still go to {files[0]}" if files else "metrics.jsonl still gets its figures"
    # "does not stop for that": true also when the Ctrl-C that took the reader down stops it next
    say(f"{stream} is closed (its reader exited); the run does not stop for that and {kept}; Ctrl-C stops it "
        "with a checkpoint")

