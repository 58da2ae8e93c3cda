"""A worker's user error, carried to its driver by kind, not by its class's name.

A worker that torchrun's engine started (trainer.launch.workers.worker_process) catches UserError at its
entry, every subclass by `isinstance`, also one defined outside dtrain. It writes its one line
into the error file torchelastic gave it (trainer/process/error_record.py) and leaves with exit
code USER_ERROR_EXIT. The driver raises one UserError with that line. Nothing here or in the
driver lists the kinds of user error.

The worker leaves by SystemExit: torchelastic's `record` would write an uncaught exception into
the same file (over this one), and lets a SystemExit pass without writing.

DTRAIN_INJECT_WORKER_ERROR=MODULE:FACTORY[@RANK] (a testing hook) makes a worker (every one, or
the one of that rank) raise what FACTORY() in MODULE returns before it runs anything else: a test
raises so a kind of user error that only the test defines, in real worker processes.
"""

from __future__ import annotations

import importlib
import os
from typing import NoReturn

from trainer.errors import UserError
from trainer.process.error_record import USER_ERROR_EXIT, USER_ERROR_KEY, write_error_record

INJECT_ENV = "DTRAIN_INJECT_WORKER_ERROR"


def leave_with_user_error(err: UserError) -> NoReturn:
    """End this worker with `err` recorded for its driver (re-raised as it is where torchelastic
    gave the worker no error file: nowhere to record it)."""
    line = str(err).strip().split("\n")[0]  # the rule's one line, should a message hold more
    if not write_error_record(type(err).__name__, line):
        raise err
    raise SystemExit(USER_ERROR_EXIT)


def reported_user_error(error_file_data) -> str | None:
    """The line of a worker that left with a user error, from its error file's data; None when it
    failed in another way."""
    line = error_file_data.get(USER_ERROR_KEY) if isinstance(error_file_data, dict) else None
    return line if isinstance(line, str) else None


def left_with_user_error(exit_code: int | None) -> bool:
    """Whether a worker process that ended with `exit_code` left with a user error (its engine's
    report of the exit, a traceback of the engine's own, is then noise above the one line)."""
    return exit_code == USER_ERROR_EXIT


def raise_injected_error() -> None:
    """The testing hook's error, in a worker it names (nothing when DTRAIN_INJECT_WORKER_ERROR is unset)."""
    spec = os.environ.get(INJECT_ENV, "").strip()
    if not spec:
        return
    target, _, rank = spec.partition("@")
    if rank and rank != os.environ.get("RANK", "0"):
        return
    module, _, factory = target.partition(":")
    raise getattr(importlib.import_module(module), factory)()
