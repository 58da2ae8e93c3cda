"""Ctrl-C, then the very same command: it continues (issue 34). No `hydra.run.dir=` and no checkpoint
key, typed in the user's own folder: the default run directory is named by the run's trajectory
keys, so the second command finds the first one's checkpoint, says it continues, and its losses are
an uninterrupted run's from there; one run directory, not two. The continued run's summary counts
every start alike (issue 45 item 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args, train_losses
from helpers.processes import logged_steps, paced, start_dtrain, wait_for_steps


@pytest.mark.slow
def test_ctrl_c_then_the_same_command_continues_the_run(data_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    args = [a for a in tiny_args(data_dir, tmp_path / "unused", "train.max_steps=12") if not a.startswith(
        ("hydra.run.dir", "train.max_steps=20"))]
    first = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=home, env=paced(dtrain_env()), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    runs = home / "outputs"
    while not runs.is_dir() or not any(runs.iterdir()):
        assert first.poll() is None, first.communicate()
        time.sleep(0.2)
    run_dir = next(runs.iterdir())
    wait_for_steps(run_dir, 4, first)
    os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole foreground group
    out, err = first.communicate(timeout=120)
    assert first.returncode == 130, out + err
    saved = [line for line in err.splitlines() if "saved" in line and "exiting with 130" in line]
    assert len(saved) == 1, err
    again = err.splitlines()[err.splitlines().index(saved[0]) + 1]  # the line after it: the command to type
    assert again.startswith("dtrain: the same command continues it: dtrain train "), again
    stopped_at = max(r["step"] for r in read_metrics(run_dir) if "loss" in r)

    second = run_dtrain(args, cwd=home, check=True)
    assert f"continuing the run in {run_dir}" in second.stderr
    assert f"resumed at step {stopped_at}" in second.stdout
    assert [p.name for p in runs.iterdir()] == [run_dir.name]  # one run directory, not two

    reference = tmp_path / "reference"
    run_dtrain([*args, f"hydra.run.dir={reference}"], cwd=REPO, check=True)
    want, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    assert {s: got[s] for s in got if s > stopped_at} == {s: want[s] for s in want if s > stopped_at}


@pytest.mark.slow
def test_a_continued_runs_summary_counts_every_start(data_dir, tmp_path):
    """Ctrl-C at about step 5 of 10, then the same command: the summary's wall_s is both starts' loop
    seconds, as its tokens and train_s are (train_s plus excluded_s is wall_s), tokens/s (wall) is
    tokens / wall_s, and this start's own seconds are beside them."""
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=10", "train.val_interval=2", "checkpoint.interval=0")
    log = tmp_path / "first.log"
    first = start_dtrain(args, log)
    wait_for_steps(run_dir, 5, first)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: saved at the step boundary
    assert first.wait(timeout=120) == 130, log.read_text()[-3000:]
    assert max(logged_steps(run_dir)) < 10

    second = run_dtrain(args, check=True)
    end = read_metrics(run_dir)[-1]
    summary = end["summary"]
    spent = summary["train_s"] + sum(end["excluded_s"].values())  # what the loop's seconds add up to
    assert summary["tokens"] == 10 * 4 * 64
    assert abs(summary["wall_s"] - spent) < 0.05, (summary, end["excluded_s"])  # both starts in both
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["wall_s"], rel=1e-9)
    assert 0 < summary["session_wall_s"] < summary["wall_s"]
    assert f"{summary['wall_s']:.1f} s (this start {summary['session_wall_s']:.1f} s)" in second.stdout
