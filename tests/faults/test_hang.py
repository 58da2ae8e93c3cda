"""A hang names the stuck rank (trainer/process/hang_watch.py), caused for real.

A ddp world-2 run whose rank 1 is frozen with SIGSTOP mid-training ends within launch.hang_timeout_s
plus a stated bound: one `error:` line naming rank 1 and the step, rank 0's stack inside the step's
backward (where DDP's all-reduce waits) in hang/rank0.txt, the frozen process gone, the newest
checkpoint intact, and the same command then continues bitwise to the uninterrupted run's end. A
rank asleep while it reads its batch (the DTRAIN_INJECT_DELAY hook) under fsdp is named as the one
that fell behind, and both ranks' stacks are on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.checkpoints import assert_continues_bitwise
from helpers.dtrain import REPO, dtrain_env, tiny_args
from helpers.errors import error_line
from helpers.processes import alive, paced, wait_for_steps, worker_pids

from trainer.process.hang_watch import (
    FLOOR_S,
    StepProgress,
    default_limit_s,
    flight_recorder_env,
    injected_delay,
)

HANG_S = 5  # launch.hang_timeout_s of these runs
# what ending may take past the limit: the other ranks' answers are awaited 5 s (the least grace),
# then the driver sees the workers exit; on a loaded 2-core machine a few seconds more
BOUND_S = 5 + 15
STEPS = 10  # frozen past step 6: the continuation resumes step 4's checkpoint and trains to 10
ARGS = ["world=2", "train.micro_batch_size=2", "train.total_batch_size=256", f"train.max_steps={STEPS}",
        "checkpoint.interval=4", f"launch.hang_timeout_s={HANG_S}"]


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env or dtrain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ends_with_one_line(proc: subprocess.Popen, since: float) -> str:
    """The run's one `error:` line, once it ended within the limit plus the bound from `since`."""
    try:
        stdout, stderr = proc.communicate(timeout=HANG_S + BOUND_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - since
    assert took < HANG_S + BOUND_S, f"the job took {took:.1f} s to end: {stderr[-2000:]}"
    return error_line(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))


def test_the_default_limit_follows_the_slowest_step_within_its_floor_and_the_process_group_timeout():
    assert default_limit_s(0.07, 300) == FLOOR_S
    assert default_limit_s(20.0, 300) == 200.0  # 10 x the slowest step
    assert default_limit_s(40.0, 300) == 240.0  # below launch.timeout_s, so the watch speaks first
    assert StepProgress(step=7, micro=1, micros=2, phase=2).describe() == "step 7, micro-step 2/2, backward"


def test_the_delay_hook_names_a_rank_a_step_and_seconds(monkeypatch):
    monkeypatch.setenv("DTRAIN_INJECT_DELAY", "1@8:60")
    delay = injected_delay()
    assert (delay.rank, delay.steps, delay.seconds) == (1, {8}, 60.0)
    assert delay.applies(1, 8) and not delay.applies(0, 8) and not delay.applies(1, 9)
    monkeypatch.setenv("DTRAIN_INJECT_DELAY", "0@*:0.5")
    assert injected_delay().applies(0, 123) and injected_delay().seconds == 0.5
    monkeypatch.delenv("DTRAIN_INJECT_DELAY")
    assert injected_delay() is None


def test_a_rank_asleep_in_its_step_is_named_as_behind(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(tiny_args(data_dir, run_dir, "parallel=fsdp", *ARGS),
                  env={**dtrain_env(), "DTRAIN_INJECT_DELAY": "1@6:600"})
    wait_for_steps(run_dir, 5, proc)
    line = _ends_with_one_line(proc, time.monotonic())
    assert "rank 1 (" in line and "fell behind, at step 6, micro-step 1/1, reading its batch" in line, line
    assert "rank 0 waited at step 6" in line, line
    asleep = (run_dir / "hang" / "rank1.txt").read_text()
    assert "trainer/fit/run.py" in asleep and "forward_backward" in asleep, asleep[-2000:]
    assert "trainer/fit/run.py" in (run_dir / "hang" / "rank0.txt").read_text()


@pytest.mark.slow
def test_a_frozen_rank_is_named_and_the_same_command_continues_bitwise(data_dir, tmp_path, shared_run):
    reference = shared_run("parallel=ddp", *ARGS)[0]
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "parallel=ddp", *ARGS)
    proc = _start(args, env=paced(dtrain_env()))  # so that the run is still training when rank 1 stops
    wait_for_steps(run_dir, 6, proc)
    workers = sorted(worker_pids(proc.pid))  # spawned in rank order
    os.kill(workers[1], signal.SIGSTOP)
    line = _ends_with_one_line(proc, time.monotonic())
    assert "rank 1 (" in line and f"pid {workers[1]}) did not answer" in line, line
    assert "rank 0 waited at step " in line and "backward" in line, line
    waiting = (run_dir / "hang" / "rank0.txt").read_text()
    assert "_engine_run_backward" in waiting and "forward_backward" in waiting, waiting[-3000:]
    assert not (run_dir / "hang" / "rank1.txt").exists()  # a frozen process writes nothing
    assert not alive(workers[1]), "the frozen rank outlived the job"

    assert_continues_bitwise(args, run_dir, reference)


def test_the_flight_recorder_is_on_unless_the_user_set_it(monkeypatch, tmp_path):
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert flight_recorder_env(tmp_path) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "hang" / "nccl_trace_rank_")}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the user turned it off, under torch's newer name
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/elsewhere/trace_")
    assert flight_recorder_env(tmp_path) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
