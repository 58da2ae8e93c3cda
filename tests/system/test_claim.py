"""One way to start a run (issue 35 item 2): a single run, a sweep point and plain torchrun's rank
0 each go through trainer/preflight/claim.py's claim_run, seen from outside the code.

Every process of each command gets a sitecustomize that logs each call of claim_run (and calls
it), and the run goes to a real disk without room for its first checkpoint: a refusal only
claim_run makes (a sweep's early checks know no run directory), so its line also shows that the
one claim ran on the way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args

from trainer.config.compose import compose
from trainer.io import flock_held
from trainer.preflight.claim import claim_run
from trainer.preflight.rundir import CONFIG_RECORD, RunDirLock, RunDirState

SPY = """
import json, os
import trainer.preflight.claim as claim

_claim_run = claim.claim_run


def claim_run(cfg, run_dir, world, lock):
    call = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "run_dir": str(run_dir)}
    try:
        state = _claim_run(cfg, run_dir, world, lock)
        call["state"] = state.value
        return state
    except Exception as err:
        call["error"] = str(err)
        raise
    finally:
        with open(os.environ["DTRAIN_TEST_CLAIMS"], "a") as log:
            log.write(json.dumps(call) + "\\n")


claim.claim_run = claim_run
"""
NO_ROOM = "not enough free space for the run's first checkpoint"


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its disks are sized for
    GPT-2-vocabulary checkpoints."""
    return gpt2_data_dir


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB file system: room for Hydra's records (and the 1 MiB a folder about to be written must
    have), none for the tiny model's first checkpoint (its embedding alone takes 12 MiB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        reason = "cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN)"
        if os.environ.get("CI", "").lower() == "true":  # CI runs as root: a skip there would hide a failure
            pytest.fail(f"{reason}; CI must run the full-disk claim tests")
        pytest.skip(reason)
    yield disk
    subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.fixture
def spied(tmp_path):
    """(the environment that logs every claim_run call, the log's reader)."""
    hook, log = tmp_path / "hook", tmp_path / "claims.jsonl"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SPY)
    env = {**dtrain_env(), "PYTHONPATH": f"{hook}:{REPO}", "DTRAIN_TEST_CLAIMS": str(log)}

    def claims() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, claims


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_single_run_is_claimed_by_claim_run(data_dir, small_disk, spied):
    env, claims = spied
    run = small_disk / "run"
    proc = run_dtrain(tiny_args(data_dir, run), env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(_error_lines(proc)) == 1 and NO_ROOM in _error_lines(proc)[0], proc.stderr
    [call] = claims()
    assert call["run_dir"] == str(run) and NO_ROOM in call["error"] and call["rank"] is None
    assert not run.exists()  # refused before anything was written


@pytest.mark.slow
def test_each_sweep_point_is_claimed_by_claim_run(data_dir, small_disk, spied):
    env, claims = spied
    sweep = small_disk / "sweep"
    args = tiny_args(data_dir, small_disk / "unused")
    proc = run_dtrain([args[0], "-m", *args[1:], f"hydra.sweep.dir={sweep}", "train.seed=0,1"], env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # Hydra's exit code for a failed point
    calls = claims()
    assert [c["run_dir"] for c in calls] == [str(sweep / "0"), str(sweep / "1")]
    assert all(NO_ROOM in c["error"] and c["rank"] is None for c in calls), calls
    for point in ("0", "1"):
        status = json.loads((sweep / point / "status.json").read_text())
        assert status["status"] == "failed" and NO_ROOM in status["error"], status


@pytest.mark.slow
def test_plain_torchrun_is_claimed_by_claim_run_on_rank_0(data_dir, small_disk, spied):
    env, claims = spied
    run = small_disk / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "trainer", *tiny_args(data_dir, run, "parallel=ddp")]
    proc = subprocess.run(torchrun, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    [call] = claims()  # rank 0's worker claims the run; rank 1 only hears of it
    assert call["rank"] == "0" and call["run_dir"] == str(run) and NO_ROOM in call["error"], call
    assert any(NO_ROOM in line for line in _error_lines(proc)), proc.stderr


def test_claim_run_leaves_the_run_directory_made_locked_and_recorded(data_dir, tmp_path):
    """In this process: what claim_run leaves once every check has passed, and nothing else."""
    cfg = compose(tiny_args(data_dir, tmp_path / "x")[1:-1])
    run = tmp_path / "run"
    lock = RunDirLock(run)
    try:
        assert claim_run(cfg, run, 1, lock) is RunDirState.NEW
        assert flock_held(run)
        assert json.loads((run / CONFIG_RECORD).read_text())["model"]["n_layer"] == 2
    finally:
        lock.release()
    assert not flock_held(run)
    assert sorted(p.name for p in Path(run).iterdir()) == [CONFIG_RECORD]
