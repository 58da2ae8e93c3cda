"""A slow rank is named (trainer/observe/stragglers.py), caused for real at world 2.

A rank asleep while it reads its batches (the DTRAIN_INJECT_DELAY hook) under ddp and fsdp, and a
rank whose core is taken by a CPU hog (its compute slowed: the profiler's op times), are each named
in one `dtrain:` notice with its host and time; every sample's times by rank are in metrics.jsonl
and the sampled steps' seconds are left out of training time. A balanced run names nobody; one
process, or train.straggler_ratio=0, samples nothing.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args
from helpers.processes import worker_pids

from trainer.observe.stragglers import StragglerWatch

STEPS = 32
SAMPLED = [11, 21, 31]  # train.log_interval=1 (tiny_args), train.straggler_every=10; never the first step
DELAY_S = 1.0


def _args(data_dir: Path, run_dir: Path, mode: str = "ddp", *extra: str) -> list[str]:
    return tiny_args(data_dir, run_dir, f"parallel={mode}", "world=2", f"train.max_steps={STEPS}",
                     "train.straggler_every=10", *extra)


def _notices(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "is a straggler" in line]


def _samples(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "rank_step_s" in r]


def _summary(run_dir: Path) -> dict:
    return next(r for r in read_metrics(run_dir) if "summary" in r)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_rank_slow_to_read_its_batches_is_named_with_its_host_and_time(mode, data_dir, tmp_path):
    env = {**dtrain_env(), "DTRAIN_INJECT_DELAY": f"1@{','.join(map(str, SAMPLED))}:{DELAY_S}"}
    proc = run_dtrain(_args(data_dir, tmp_path / "run", mode), env=env, check=True)
    notices = _notices(proc.stderr)
    assert len(notices) == 1, proc.stderr[-3000:]
    assert notices[0].startswith(f"dtrain: rank 1 on {socket.gethostname()} is a straggler"), notices[0]
    samples = _samples(tmp_path / "run")
    assert [r["rank_step_at"] for r in samples] == SAMPLED
    for record in samples:
        fast, slow = record["rank_step_s"]
        assert slow >= DELAY_S and slow - fast > 0.5 * DELAY_S, record  # rank 0 waited: not its own time
        assert record["step"] == record["rank_step_at"] + 1  # logged with the next step, whose check carried it
    # the sampled steps (and so the delays) are not training time: tokens/s leaves them out
    assert _summary(tmp_path / "run")["excluded_s"]["straggler_sample"] > len(SAMPLED) * DELAY_S
    if mode == "ddp" and importlib.util.find_spec("matplotlib"):  # dtrain report draws each rank's times
        run_dtrain(["report", str(tmp_path / "run"), "--out", str(tmp_path / "figures")], check=True)
        assert (tmp_path / "figures" / "ranks.png").read_bytes().startswith(b"\x89PNG")


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads made later inherit the main thread's)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def _set_priority(pid: int, nice: int) -> bool:
    """Set `pid`'s nice value; False where this user may not (raising a priority needs root)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except PermissionError:
        return False
    return True


def _pinned_run(data_dir: Path, run_dir: Path, rank_nice: tuple[int, int], hog_nice: int | None) -> str:
    """A world-2 ddp run with each rank pinned to a core of its own at the nice values `rank_nice`
    (from before its first step), and with `hog_nice` a busy loop at that nice value on rank 1's
    core; its stderr. Micro batches of 16 make a step's compute (about 20 ms on a core of its own)
    several of the scheduler's slices long: over a few milliseconds a rank just woken from a
    collective's wait runs ahead of whatever shares its core, and another process's one slice in the
    middle of a 6 ms step makes it 1.5x. Skips where raising a priority is not allowed (root only)."""
    cpu0, cpu1 = sorted(os.sched_getaffinity(0))[:2]
    args = _args(data_dir, run_dir, "ddp", "train.micro_batch_size=16")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=dtrain_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hog = None
    try:
        deadline = time.monotonic() + 120
        while len(workers := sorted(worker_pids(proc.pid))) < 2:  # spawned in rank order
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        for pid, cpu, nice in zip(workers, (cpu0, cpu1), rank_nice):
            _pin(pid, {cpu})
            if not _set_priority(pid, nice):
                pytest.skip("raising a rank's priority needs root")
        if hog_nice is not None:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            os.sched_setaffinity(hog.pid, {cpu1})
            assert _set_priority(hog.pid, hog_nice)
        _, stderr = proc.communicate(timeout=600)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    return stderr


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for each rank")
def test_a_rank_whose_core_a_cpu_hog_shares_is_named(data_dir, tmp_path):
    """Rank 0 above everything else on its core (nice -20), and a busy loop above rank 1 on rank 1's
    (nice -5): rank 1's ops (its compute, as the profiler times them) take several times as long as
    rank 0's, however busy the machine is otherwise."""
    stderr = _pinned_run(data_dir, tmp_path / "run", (-20, 0), hog_nice=-5)
    notices = _notices(stderr)
    assert len(notices) == 1 and notices[0].startswith(f"dtrain: rank 1 on {socket.gethostname()}"), stderr[-3000:]
    assert all(r["rank_step_s"][1] > 1.2 * r["rank_step_s"][0] for r in _samples(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for each rank")
def test_a_balanced_run_names_nobody(data_dir, tmp_path):
    """Both ranks above everything else on their own cores (nice -20): a busy machine (CI's other
    tests) took turns on a rank's core in three samples in a row otherwise, and named it."""
    stderr = _pinned_run(data_dir, tmp_path / "balanced", (-20, -20), hog_nice=None)
    assert not _notices(stderr), stderr[-3000:]
    samples = _samples(tmp_path / "balanced")
    assert [r["rank_step_at"] for r in samples] == SAMPLED
    assert all(len(r["rank_step_s"]) == 2 and min(r["rank_step_s"]) > 0 for r in samples)


def test_one_process_or_ratio_zero_samples_nothing():
    def watch(world: int, ratio: float) -> StragglerWatch:
        cfg = SimpleNamespace(train=SimpleNamespace(straggler_ratio=ratio, straggler_every=10, log_interval=1))
        rt = SimpleNamespace(distributed=world > 1, world=world, rank=0, is_main=True)
        return StragglerWatch(cfg, rt, lambda: 0.0)

    for world, ratio in ((1, 1.2), (4, 0.0)):
        off = watch(world, ratio)
        assert not any(off.samples(step, first_step=1) for step in range(1, 100))
        assert off.rider("cpu") is None and off.take_record() == {}
