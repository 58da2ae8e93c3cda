"""One run per directory: a live run's directory is locked, a finished run is not run again, a
crashed run is continued by the same command, and another run's outputs are never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:") and sum(x.startswith("error:") for x in lines) == 1, lines
    return lines[-1]


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def start(args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=dtrain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_steps(run_dir, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps logged in {timeout} s")


def test_a_second_run_in_a_live_runs_directory_is_refused_and_touches_nothing(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    first = start(tiny_args(data_dir, run_dir, "train.max_steps=100000"))
    try:
        wait_for_steps(run_dir, 2, first)
        for extra in ([], ["optim.lr=1e-3"], ["resume=never"]):  # the same command, or another run
            before = {name: data for name, data in snapshot(run_dir).items() if name != "metrics.jsonl"}
            line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=100000", *extra)))
            assert "in use by another dtrain run" in line and f"pid {first.pid}" in line, line
            after = {name: data for name, data in snapshot(run_dir).items() if name != "metrics.jsonl"}
            assert after == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_a_finished_run_is_not_run_again_and_max_steps_cannot_change(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4"), check=True)
    before = snapshot(run_dir)
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4"))
    assert proc.returncode == 0, proc.stderr
    assert "already finished" in proc.stdout and "nothing to do" in proc.stdout, proc.stdout
    assert snapshot(run_dir) == before  # nothing appended, nothing rewritten
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=8")))
    assert "train.max_steps=4" in line and "schedule" in line, line
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4", "optim.lr=1e-3")))
    assert "another run's outputs" in line and "optim.lr" in line, line
    assert snapshot(run_dir) == before


def test_a_crashed_run_without_a_checkpoint_is_continued_by_the_same_command(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=150")
    crashed = start(args)
    wait_for_steps(run_dir, 2, crashed)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait()
    record = (run_dir / "resolved_config.json").read_text()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    run_dtrain(args, check=True)
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 151))  # started over: every step once, none from the crashed attempt twice
    assert (run_dir / "resolved_config.json").read_text() == record
    summary = [r for r in read_metrics(run_dir) if "summary" in r]
    assert len(summary) == 1 and json.dumps(summary[0]["summary"])
