"""Errors a user can cause: the CLI turns them into one clear line and exit code 2."""


class UserError(Exception):
    """A problem the user can fix. The message names the problem and the fix in one line."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass
