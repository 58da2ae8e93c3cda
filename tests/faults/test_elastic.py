"""Elastic fault tolerance: SIGKILL one worker mid-run; torchelastic restarts the workers, they
resume from the newest checkpoint, and the run ends exactly as an uninterrupted one."""

from __future__ import annotations

import os
import signal

from helpers.checkpoints import loss_records, same_weights
from helpers.dtrain import tiny_args
from helpers.processes import past_a_checkpoint, start_dtrain, wait_for, worker_pids
from helpers.runs import CKPT_ARGS, STEPS, checkpointed


def test_killed_worker_is_restarted_and_the_run_matches(data_dir, references, tmp_path):
    reference = references("ddp")
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *checkpointed("ddp"), "launch.max_restarts=1"), log)
    try:
        wait_for(lambda: past_a_checkpoint(run_dir), proc, log)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)  # one worker only: the agent must notice and restart
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert "resuming from" in output, output[-3000:]
    records = loss_records(run_dir)
    assert [r[0] for r in records] == list(range(1, STEPS + 1)), "metrics.jsonl lost or repeated a step"
    assert records == loss_records(reference)  # losses and grad norms, bit for bit
    assert same_weights(run_dir, reference)
