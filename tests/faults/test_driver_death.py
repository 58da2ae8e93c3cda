"""kill -9 of the driver, for real: the workers' parent-death SIGINT (torch's spawn sets it) is not a
stop request. A worker whose driver died says so and exits; it never claims a save it does not make
("SIGINT received: saving a checkpoint ..."), and no checkpoint appears after the kill."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers.dtrain import tiny_args
from helpers.processes import alive, logged, start_dtrain, wait_for, worker_pids

from trainer.checkpoint.layout import list_checkpoints

TRIALS, DEADLINE_S = 2, 15


def _checkpoints(run_dir) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir / "checkpoints")]


@pytest.mark.slow
def test_driver_killed_workers_say_so_and_claim_no_save(data_dir, tmp_path):
    for trial in range(TRIALS):
        run_dir, log = tmp_path / f"run{trial}", tmp_path / f"killed{trial}.log"
        args = tiny_args(data_dir, run_dir, "parallel=fsdp", "world=2", "train.max_steps=100000",
                         "checkpoint.interval=0")
        proc = start_dtrain(args, log)
        wait_for(lambda d=run_dir: logged(d, at_least=2), proc, log)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        try:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            deadline = time.monotonic() + DEADLINE_S
            while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(alive(pid) for pid in workers), f"trial {trial}: a worker outlived its driver"
        finally:
            for pid in workers:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        # rank 0 writes to the driver's terminal (the log); rank 1 to its own log file
        text = log.read_text() + "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
        assert "saving a checkpoint" not in text, f"trial {trial}: a false notice:\n{text[-2000:]}"
        assert "died" in text, f"trial {trial}: no worker said its driver died:\n{text[-2000:]}"
        assert _checkpoints(run_dir) == [], f"trial {trial}: a checkpoint appeared after the kill"
