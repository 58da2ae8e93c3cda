"""A run whose output's reader leaves, caused for real: `dtrain train ... | head -3` (the test reads
three lines of a real pipe and closes it), `2>&1 | head` (stderr gone too), and Ctrl-C on
`dtrain train ... 2>&1 | tee log`, where the terminal's SIGINT reaches the whole process group and
tee dies with dtrain. Training goes on to its end (exit 0) with every line in dtrain.log and every
figure in metrics.jsonl; the Ctrl-C still saves, writes its stop line to dtrain.log and exits 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.dtrain import REPO, args_with, dtrain_env, read_metrics
from helpers.processes import logged, paced

from trainer.checkpoint.layout import checkpoint_step, is_complete, latest_checkpoint
from trainer.observe.metrics import ProgressView
from trainer.process import streams
from trainer.process.streams import reader_proof, when_a_reader_leaves

STEPS = 10
CLOSED_NOTICE = re.compile(r"^(?:dtrain: |.*\[dtrain\]\[INFO\] - )stdout is closed \(its reader exited\); "
                           r"the run does not stop for that and its lines still go to (\S+); "
                           r"Ctrl-C stops it with a checkpoint$",
                           re.M)
STOP_IN_LOG = re.compile(r"\] - SIGINT at step (\d+): saved (\S+); exiting with 130$", re.M)
WORLDS = {1: (), 2: ("parallel=ddp", "world=2")}


# How a terminal's shell starts a foreground job: SIGINT at its default action and not blocked. Both
# survive exec, so a child would otherwise inherit what pytest was started with: `make test &` from a
# script (a shell without job control) ignores SIGINT for it, and a tee started so outlives the
# Ctrl-C, exits 0 at dtrain's end of file, and the pipe was never taken down.
FOREGROUND = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execvp(sys.argv[1], sys.argv[1:])")


def _in_the_foreground(command: list[str]) -> list[str]:
    """`command` as a terminal's foreground job starts it: the same process (exec), SIGINT reset."""
    return [sys.executable, "-c", FOREGROUND, *command]


def _dtrain(args: list[str], foreground: bool = False, **streams) -> subprocess.Popen:
    command = [sys.executable, "-m", "trainer", *args]
    return subprocess.Popen(_in_the_foreground(command) if foreground else command, cwd=REPO, env=paced(dtrain_env()),
                            text=True, **streams)


@pytest.mark.parametrize("world, closed", [(1, "stdout"), pytest.param(1, "stdout and stderr", marks=pytest.mark.slow),
                                           pytest.param(2, "stdout", marks=pytest.mark.slow)])
def test_a_reader_that_leaves_ends_nothing(world, closed, data_dir, tmp_path):
    """`dtrain train ... | head -3` (or `2>&1 | head -3`): the old failure was a BrokenPipeError
    traceback from the step line's print, exit 1 and no checkpoint. Now the run trains to its last
    step and exits 0, says once that stdout closed (on stderr while its reader is there, and in
    dtrain.log), and dtrain.log and metrics.jsonl hold every step."""
    run_dir = tmp_path / "run"
    args = args_with(data_dir, run_dir, f"train.max_steps={STEPS}", "checkpoint.interval=4", *WORLDS[world])
    stderr_file = tmp_path / "stderr.txt"
    with stderr_file.open("w") as err:
        proc = _dtrain(args, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT if closed == "stdout and stderr" else err)
        head = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()  # head -3 exits
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    stderr = stderr_file.read_text()
    assert head[0].startswith("dtrain model=tiny") and head[1].startswith("step 1/"), head
    assert code == 0, f"exit code {code}:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr[-3000:]
    log = (run_dir / "dtrain.log").read_text()
    assert [Path(m) for m in CLOSED_NOTICE.findall(log)] == [run_dir / "dtrain.log"], log[-3000:]
    if closed == "stdout":  # stderr's reader is still there: it is told too
        assert len(CLOSED_NOTICE.findall(stderr)) == 1, stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == list(range(1, STEPS + 1))
    assert "summary" in read_metrics(run_dir)[-1]
    assert re.search(rf"\] - step {STEPS}/{STEPS} \| loss ", log), log[-3000:]
    assert re.search(rf"\] - run summary: steps {STEPS} ", log), log[-3000:]
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and is_complete(ckpt) and checkpoint_step(ckpt) == STEPS


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ctrl_c_that_takes_the_pipe_down_saves_says_so_in_dtrain_log_and_exits_130(world, data_dir, tmp_path):
    """`dtrain train ... 2>&1 | tee log` and Ctrl-C: the terminal sends SIGINT to the foreground
    process group, dtrain (and its workers) and tee at once. The old failure: the checkpoint was
    saved, but the stop line's print raised BrokenPipeError (exit 1, not 130), and the line reached
    neither the terminal nor dtrain.log. Now: exit 130, and dtrain.log holds the stop line naming
    the checkpoint and the command that continues it."""
    run_dir, tee_log = tmp_path / "run", tmp_path / "tee.log"
    args = args_with(data_dir, run_dir, "train.max_steps=100000", "checkpoint.interval=0", *WORLDS[world])
    # the shell's pipeline: one process group of its own (in this session: a group may only be joined there)
    proc = _dtrain(args, foreground=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
    tee = subprocess.Popen(_in_the_foreground(["tee", str(tee_log)]), stdin=proc.stdout, stdout=subprocess.DEVNULL,
                           process_group=proc.pid)
    proc.stdout.close()  # tee is the pipe's only reader
    try:
        deadline = time.monotonic() + 300
        while not logged(run_dir, at_least=2):
            assert proc.poll() is None and time.monotonic() < deadline, tee_log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        tee.wait(timeout=60)
    assert code == 128 + signal.SIGINT, f"exit code {code}:\n{tee_log.read_text()[-3000:]}"
    # The group's SIGINT is queued for tee and dtrain in one kill(2); tee, blocked in read(), dies by it
    # before it could see an end of file, which only a dtrain that had closed its stdout (or ended)
    # before the Ctrl-C would have given it: so the pipe's reader was taken down, with dtrain alive.
    assert tee.returncode == -signal.SIGINT, f"tee exit code {tee.returncode}: the pipe's reader was not taken down"
    log = (run_dir / "dtrain.log").read_text()
    lines = STOP_IN_LOG.findall(log)
    assert len(lines) == 1, log[-3000:]
    step, saved = lines[0]
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and is_complete(ckpt) and Path(saved) == ckpt and checkpoint_step(ckpt) == int(step)
    assert "] - the same command continues it: dtrain train " in log, log[-3000:]


def test_a_stream_whose_reader_left_takes_every_write_and_says_so_once(monkeypatch):
    """In one process, on a real pipe: once the reader closes its end, writes and flushes go on
    without an error, the descriptor points at /dev/null (C code writing to it is fine too), and
    the listener is told once."""
    monkeypatch.setattr(streams, "_told", False)  # once per process: this test's, not the session's
    read_end, write_end = os.pipe()
    original = os.fdopen(write_end, "w", buffering=1)  # owns the descriptor, as sys.__stdout__ does
    stream = reader_proof(original)
    told = []
    stream.write("before\n")
    assert os.read(read_end, 100) == b"before\n"
    os.close(read_end)
    with when_a_reader_leaves(told.append):
        for _ in range(3):
            stream.write("after\n")
            stream.flush()
        os.write(write_end, b"from C\n")
    assert told == [f"file descriptor {write_end}"]
    assert os.path.samefile(f"/proc/self/fd/{write_end}", os.devnull)


def test_the_summary_box_prints_a_long_run_dir_whole_into_a_pipe(monkeypatch, tmp_path):
    """rich lays out a table for a pipe in 80 columns: the run directory ended in "…" there (seen
    with `dtrain train ... | tee log`). Now it prints whole, on one line of the box."""
    run_dir = str(tmp_path / ("a-run-directory-with-a-long-name-" * 3) / "run")
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_end, "w"))
    ProgressView(0, 10, 10).summary("run summary", {"steps": "10", "run dir": run_dir})
    sys.stdout.close()
    with os.fdopen(read_end) as pipe:
        shown = pipe.read()
    assert len(run_dir) > 80 and "…" not in shown, shown
    assert re.search(rf"│ run dir +│ {re.escape(run_dir)} +│", shown), shown
