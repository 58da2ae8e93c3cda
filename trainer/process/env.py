"""What the launcher told this process through its environment (torch-free: the checking layer
reads it before torch is imported)."""

from __future__ import annotations

import os

# The `dtrain train ...` command that continues this run: set by dtrain's driver, for the line a
# stop signal prints in the worker that saved.
CONTINUE_COMMAND_ENV = "DTRAIN_CONTINUE_COMMAND"


def under_torchrun() -> bool:
    """Started by torchrun (or its engine): RANK / WORLD_SIZE describe this worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launched_world() -> int | None:
    """WORLD_SIZE when a launcher set it, else None."""
    value = os.environ.get("WORLD_SIZE")
    return None if value is None else int(value)


def is_secondary_rank() -> bool:
    """A worker of plain torchrun other than rank 0 (it writes nothing to the run directory)."""
    return os.environ.get("RANK", "0") != "0"


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job's workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def continue_command() -> str | None:
    """The command that continues this run (None under plain torchrun or in a sweep point)."""
    return os.environ.get(CONTINUE_COMMAND_ENV)
