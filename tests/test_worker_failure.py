"""A worker that dies makes the whole job fail promptly with that worker's error, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, dtrain_env, tiny_args


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def worker_pids(driver: int) -> list[int]:
    pids = []
    for child in children(driver):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
            pids.append(child)
    return pids


def test_killed_worker_fails_the_job_with_its_error(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=100000")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=dtrain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)  # fails promptly: no hang in the all-reduce
        assert proc.returncode not in (0, None)
        assert "Traceback" not in stderr.splitlines()[0] if stderr else True
        assert "failed" in stderr and "rank" in stderr and "SIGKILL" in stderr, stderr[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
