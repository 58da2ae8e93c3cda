"""A worker's user error reaches the user by kind (trainer/launch/worker_errors.py), not by its class's
name: every kind dtrain has, and one that only a test module defines, raised in a real world-2
worker, ends as its one `error:` line, exit code 2, no traceback."""

from __future__ import annotations

import importlib
import json
import pkgutil

import pytest
from helpers import user_error_kinds
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args
from helpers.errors import one_line_error
from helpers.user_error_kinds import LINES, OnlyInATest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import trainer
from trainer.errors import UserError
from trainer.launch.worker_errors import INJECT_ENV, leave_with_user_error, reported_user_error
from trainer.launch.workers import ERROR_FILE_NAME, recorded_line
from trainer.process.error_record import ERROR_FILE_ENV, USER_ERROR_EXIT, USER_ERROR_KEY

TESTS = REPO / "tests"


def _kinds(cls: type) -> set[type]:
    return {cls} | {kind for sub in cls.__subclasses__() for kind in _kinds(sub)}


def test_every_kind_of_user_error_in_dtrain_is_covered_here():
    """user_error_kinds.py raises every kind of user error dtrain defines (a new kind joins it)."""
    for module in pkgutil.walk_packages(trainer.__path__, "trainer."):
        if module.name == "trainer.__main__":
            continue
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as err:  # an optional extra that is not installed here
            assert not (err.name or "").startswith("trainer"), err
    dtrain_kinds = {k.__name__ for k in _kinds(UserError) if k.__module__.startswith("trainer.")}
    raised = {type(getattr(user_error_kinds, name)()).__name__ for name in LINES}
    assert dtrain_kinds == raised - {OnlyInATest.__name__}


def test_the_record_a_worker_leaves_is_read_back_by_kind(tmp_path, monkeypatch):
    """In one process: the worker's side writes torchelastic's error file and exits 2; the
    driver's side reads the line back from the file's data, whatever the kind's name."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(SystemExit) as left:
        leave_with_user_error(OnlyInATest("only here; fix it"))
    assert left.value.code == USER_ERROR_EXIT
    data = json.loads(error_file.read_text())
    assert reported_user_error(data) == "only here; fix it"
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0  # torchelastic picks the first failure by it
    assert reported_user_error({"message": "RuntimeError: boom"}) is None


def _raise_in_worker(data_dir, run_dir, kind: str, rank: str):
    env = {**dtrain_env(), INJECT_ENV: f"helpers.user_error_kinds:{kind}{rank}",
           "PYTHONPATH": f"{TESTS}:{dtrain_env().get('PYTHONPATH', REPO)}"}
    return run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=2"), env=env)


@pytest.mark.slow
@pytest.mark.parametrize("rank", ["@1", ""], ids=["rank 1", "every rank"])
def test_a_kind_only_a_test_defines_crosses_from_a_world_2_worker(rank, data_dir, tmp_path):
    proc = _raise_in_worker(data_dir, tmp_path / "run", "only_in_a_test", rank)
    assert one_line_error(proc) == f"error: {LINES['only_in_a_test']}"
    assert "Traceback" not in proc.stdout
    # The peer still waiting for rank 1 in its process group's setup takes the launcher's SIGTERM
    # for the teardown it is and exits: torch's agent never waits out its 30 s for a SIGKILL.
    assert "forcefully exiting via" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", sorted(LINES))
def test_every_kind_leaves_its_one_line_in_the_record(kind, tmp_path, monkeypatch):
    """Every kind through the worker's real record and the driver's reading of it, in one process
    (the world-2 crossing itself is the same code for every kind: the tests around this one)."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(SystemExit):
        leave_with_user_error(getattr(user_error_kinds, kind)())
    assert reported_user_error(json.loads(error_file.read_text())) == LINES[kind]


@pytest.mark.slow
def test_a_corrupt_checkpoint_crosses_from_a_world_2_worker(data_dir, tmp_path):
    """CorruptCheckpoint, the kind the old list of names missed, across a real world-2 launch."""
    kind = "corrupt_checkpoint"
    proc = _raise_in_worker(data_dir, tmp_path / "run", kind, "@1")
    assert one_line_error(proc) == f"error: {LINES[kind]}"
    assert "Traceback" not in proc.stdout


def test_a_recorded_line_wins_though_another_worker_is_the_first_failure(tmp_path):
    """A hang's reporting rank records its line, then ends the frozen rank (-9): the agent may stop on
    that death alone, before the reporting rank is among the failures. The driver still finds the
    line, in the other worker's error file beside the failed one's."""
    run_logs = tmp_path / "run-id_x1y2"
    attempt = run_logs / "attempt_1"  # a restart's: the last attempt is read
    for folder in (run_logs / "attempt_0" / "0", attempt / "0", attempt / "1"):
        folder.mkdir(parents=True)
    (run_logs / "attempt_0" / "0" / ERROR_FILE_NAME).write_text(json.dumps({USER_ERROR_KEY: "an earlier attempt's"}))
    # the killed worker left no file: torchelastic's failure holds no path to it
    frozen = ProcessFailure(local_rank=1, pid=4321, exitcode=-9, error_file=str(attempt / "1" / ERROR_FILE_NAME))
    err = ChildFailedError("trainer", {1: frozen})
    assert recorded_line(err, str(run_logs)) is None  # nothing recorded yet: the driver reports the failure
    (attempt / "0" / ERROR_FILE_NAME).write_text(json.dumps({USER_ERROR_KEY: "the run hung: rank 1 did not answer"}))
    assert recorded_line(err, str(run_logs)) == "the run hung: rank 1 did not answer"
    assert recorded_line(err, None) is None
