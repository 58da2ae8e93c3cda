"""A worker that dies makes the whole job fail promptly with that worker's error, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, tiny_args
from helpers.processes import worker_pids

from trainer.process.signals import proc_status, signal_pending


@contextmanager
def ddp_run(data_dir: Path, run_dir: Path) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """A ddp world-2 run past its first steps, and its workers' pids (rank order); killed if the test
    leaves it running."""
    args = tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=100000")
    # not from the test's environment: torch's elastic engine enables faulthandler in its workers
    env = {k: v for k, v in dtrain_env().items() if k != "PYTHONFAULTHANDLER"}
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        workers = sorted(worker_pids(proc.pid))  # spawned in rank order
        assert len(workers) == 2, workers
        yield proc, workers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_killed_worker_fails_the_job_with_its_error(data_dir, tmp_path):
    with ddp_run(data_dir, tmp_path / "run") as (proc, workers):
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # fails promptly: no hang in the all-reduce
    assert proc.returncode not in (0, None)
    assert "Traceback" not in stderr.splitlines()[0] if stderr else True
    assert "failed" in stderr and "rank" in stderr and "SIGKILL" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_crashed_worker_shows_where_and_its_peer_claims_no_save(data_dir, tmp_path):
    """A segfault in a worker (a real SIGSEGV): its log holds the Python stack it crashed in. Torch's
    agent then tears rank 0 down with SIGTERM, which rank 0 must not take for a stop request that it
    announces as a save: rank 0 is held stopped until the agent's SIGTERM is pending on it, so that
    it handles that signal for sure instead of dying of the broken all-reduce first."""
    run_dir = tmp_path / "run"
    with ddp_run(data_dir, run_dir) as (proc, workers):
        os.kill(workers[0], signal.SIGSTOP)
        os.kill(workers[1], signal.SIGSEGV)
        deadline = time.monotonic() + 60
        while not signal_pending(proc_status(workers[0]), signal.SIGTERM):
            assert time.monotonic() < deadline, "torch's agent never sent rank 0 a SIGTERM"
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    assert "worker rank 1 failed" in stderr and "SIGSEGV" in stderr, stderr[-2000:]
    crashed = "".join(p.read_text() for p in run_dir.glob("logs/*/attempt_0/1/stderr.log"))
    assert "Fatal Python error: Segmentation fault" in crashed, crashed[-2000:]
    assert "trainer/fit/loop.py" in crashed, crashed[-3000:]  # the step it was in
    everything = stderr + "".join(p.read_text() for p in run_dir.rglob("*.log"))
    assert "saving a checkpoint" not in everything, everything[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
