"""Errors a user can cause (the CLI turns them into one clear line and exit code 2), and a worker's
failure that is not the user's (one line and its report, exit code 1)."""


class UserError(Exception):
    """A problem the user can fix. The message names the problem and the fix in one line."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class DeviceOutOfMemory(UserError):
    """A training step ran out of device memory (trainer/observe/memory.py): the line names the step,
    the peak, the snapshot written, and the settings that need less memory."""


class WorkerFailed(Exception):
    """A worker died for a reason that is not the user's input; carries its error report."""


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGINT, SIGUSR1) ended the run at a step boundary, its checkpoint
    saved: the process exits with 128 + signum. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way up takes a requested stop for a failure."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class NonFiniteError(WorkerFailed):
    """Training met a non-finite loss or gradient norm (or weights) and stopped before updating or
    saving (train.on_nonfinite); the message is one line naming the step and the newest finite
    checkpoint (exit code 1)."""
