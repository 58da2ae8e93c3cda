"""Kinds of user error for workers to raise through DTRAIN_INJECT_WORKER_ERROR=helpers.user_error_kinds:NAME
(trainer/launch/worker_errors.py): every kind dtrain has, and one that only this test module defines.
Each factory returns the error; its line says which kind it is."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.integrity import CorruptCheckpoint
from trainer.config.compose import compose
from trainer.errors import CheckpointError, ConfigError, DataError, DeviceOutOfMemory, UserError
from trainer.observe.memory import out_of_memory_line


class OnlyInATest(UserError):
    """A kind of user error dtrain has never heard of."""


def only_in_a_test() -> UserError:
    return OnlyInATest("a kind of user error only a test defines; fix the test's input")


def user_error() -> UserError:
    return UserError("a plain UserError from a worker; fix the input")


def config_error() -> UserError:
    return ConfigError("a ConfigError from a worker; fix the config")


def data_error() -> UserError:
    return DataError("a DataError from a worker; fix the data")


def checkpoint_error() -> UserError:
    return CheckpointError("a CheckpointError from a worker; fix the checkpoint")


def corrupt_checkpoint() -> UserError:
    return CorruptCheckpoint(Path("/nowhere/checkpoints/step_000004"), "a flipped byte in a shard")


def device_out_of_memory() -> UserError:
    return DeviceOutOfMemory(out_of_memory_line(compose(["model=tiny"]), 3, 1, 70 * 2**30, 80 * 2**30,
                                                Path("/nowhere/memory/rank1_step3_oom.pickle")))


# name -> the line the user must see
LINES = {factory.__name__: str(factory()) for factory in
         (only_in_a_test, user_error, config_error, data_error, checkpoint_error, corrupt_checkpoint,
          device_out_of_memory)}
