"""Logs wherever the run is: one plain line per logged step without a terminal (a pipe, a file, nohup,
Slurm), the live bar on one; the same lines in the run directory's dtrain.log (Hydra's job log)
exactly once; the workers' own log files hold what they print; the summary's two tokens/s figures
say which is which, and the "training steps" one is the step lines' measure over the whole run."""

from __future__ import annotations

import logging
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args, tokenizer_args
from helpers.processes import paced
from helpers.runs import REFERENCE_BATCH, REFERENCE_STEPS, on_reference_steps

from trainer.observe.metrics import ProgressView
from trainer.process.joblog import JOB_LOG_ENV, LOG, RANK_LINES_ENV, job_log

STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss (\d+\.\d{4}) \| lr \d\.\d\de-\d\d \| [\d,]+ tok/s"
                       r"(?: \| mfu [\d.]+%)? \| eta (?:-|\d+:\d\d:\d\d)$")
JOB_LOG_RECORD = re.compile(r"^\[[\d-]+ [\d:,]+\]\[dtrain\]\[INFO\] - (.*)$")


def step_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(step, loss as printed) of each plain step line, in order."""
    return [(int(m[1]), m[3]) for m in map(STEP_LINE.match, lines) if m]


def job_log_messages(run_dir: Path) -> list[str]:
    """The messages of dtrain's records in the run's dtrain.log (a message's further lines dropped)."""
    lines = (run_dir / "dtrain.log").read_text().splitlines()
    return [m[1] for m in map(JOB_LOG_RECORD.match, lines) if m]


@pytest.mark.parametrize("mode", ["none", "ddp"])
def test_without_a_terminal_every_logged_step_is_a_line_on_stdout_and_in_dtrain_log(mode, shared_run):
    """The session's parity runs (stdout a pipe, as under `| tee` or nohup): one line per step on
    stdout, the same lines once each in dtrain.log (rank 0 of the ddp run is a worker process, not
    the one Hydra's job logging set up); the losses are metrics.jsonl's."""
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *on_reference_steps(mode))
    losses = {r["step"]: f"{r['loss']:.4f}" for r in read_metrics(run_dir) if "loss" in r}
    expected = [(step, losses[step]) for step in range(1, REFERENCE_STEPS + 1)]
    assert step_lines(stdout.splitlines()) == expected, stdout
    messages = job_log_messages(run_dir)
    assert step_lines(messages) == expected, messages
    printed = [line for line in stdout.splitlines() if STEP_LINE.match(line)]
    assert [m for m in messages if STEP_LINE.match(m)] == printed
    assert sum(m.startswith("dtrain model=tiny") for m in messages) == 1
    assert sum(m.startswith(f"step {REFERENCE_STEPS}: val loss ") for m in messages) == 1
    assert sum(m.startswith("run summary: ") for m in messages) == 1
    assert not any(m.startswith("rank ") for m in messages)  # rank 1's lines stay in its own file


def test_a_worker_log_file_holds_what_its_worker_printed(shared_run):
    """Rank 1 of a world-2 run prints to the log file dtrain's launcher gives it: its start, one
    line per logged step and its end; rank 0's lines are the terminal's and dtrain.log's."""
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *on_reference_steps("ddp"))
    (worker_log,) = run_dir.glob("logs/*/attempt_0/1/stdout.log")
    lines = worker_log.read_text().splitlines()
    assert lines[0].startswith("rank 1: pid ") and "world 2" in lines[0], lines
    ranked = [line.removeprefix("rank 1: ") for line in lines[1:-1]]
    assert [step for step, _ in step_lines(ranked)] == list(range(1, REFERENCE_STEPS + 1)), lines
    assert lines[-1] == f"rank 1: finished at step {REFERENCE_STEPS}"
    assert "rank 1:" not in stdout


def test_the_summary_names_both_rates_and_the_training_one_is_the_step_lines(shared_run):
    """The step lines measure tokens/s over training steps only; the summary's "training steps"
    figure is that measure over the whole run but its first step (all later logged windows together), and its wall-clock
    figure (evaluation and checkpoints included) is labelled as such."""
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *on_reference_steps("none"))
    assert re.search(r"tokens/s \(training steps\)\s+│ [\d,]+ ", stdout), stdout
    assert re.search(r"tokens/s \(wall, with eval \+ ckpt\)\s+│ [\d,]+ ", stdout), stdout
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    summary = records[-1]["summary"]
    # log_interval 1: one 256-token step a window; the first step (compilation, warm-up) is left out
    seconds = sum(256 / r["tokens_per_s"] for r in train[1:])
    assert summary["train_tokens_per_s"] == pytest.approx(256 * len(train[1:]) / seconds, rel=1e-5)
    assert summary["tokens_per_s"] <= summary["train_tokens_per_s"]  # the wall clock holds more than the steps


def _show_steps(view: ProgressView) -> None:
    for step in (1, 2, 3):
        view.update(step, 4.0 - step / 10, 1e-3, 1234.0, None, 10.0 - step)
    view.close()


def test_a_pipe_gets_plain_lines_even_with_the_bar_on(capfd, caplog):
    """train.progress=true (the default) without a terminal: lines, flushed, and the same in the log."""
    assert not sys.stdout.isatty()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _show_steps(ProgressView(0, 10, 0, bar=True))
    out = capfd.readouterr().out.splitlines()
    assert out == ["step 1/10 | loss 3.9000 | lr 1.00e-03 | 1,234 tok/s | eta 0:00:09",
                   "step 2/10 | loss 3.8000 | lr 1.00e-03 | 1,234 tok/s | eta 0:00:08",
                   "step 3/10 | loss 3.7000 | lr 1.00e-03 | 1,234 tok/s | eta 0:00:07"]
    assert [r.getMessage() for r in caplog.records] == out


def test_a_terminal_gets_the_bar_and_no_plain_lines(monkeypatch, caplog):
    """On a terminal (a real pty) the bar shows the steps and no plain line is printed; the job
    log still gets every step line. train.progress=false there: the plain lines."""
    for bar, want_lines in ((True, False), (False, True)):
        primary, secondary = pty.openpty()
        terminal = os.fdopen(secondary, "w")
        monkeypatch.setattr(sys, "stdout", terminal)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOG.name):
            _show_steps(ProgressView(0, 10, 0, bar=bar))
        terminal.close()
        shown = _read_all(primary)
        assert bool(re.search(r"step \d+/10 \| loss", shown)) == want_lines, shown
        if not want_lines:
            assert "step 3/10" in shown and "loss 3.7000 | lr 1.00e-03 | 1,234 tok/s" in shown, shown
        assert [r.getMessage().split(" | ")[0] for r in caplog.records] == ["step 1/10", "step 2/10", "step 3/10"]


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything is read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def test_ranks_other_than_0_print_only_where_the_launcher_gives_them_a_file(monkeypatch, capfd):
    """Plain torchrun's ranks share a terminal: rank 1 prints nothing there; under dtrain's launcher
    (which sends its output to its own log file) it prints its lines, prefixed with its rank."""
    monkeypatch.delenv(RANK_LINES_ENV, raising=False)
    _show_steps(ProgressView(1, 10, 0))
    assert capfd.readouterr().out == ""
    monkeypatch.setenv(RANK_LINES_ENV, "1")
    _show_steps(ProgressView(1, 10, 0))
    first = capfd.readouterr().out.splitlines()[0]
    assert first == "rank 1: step 1/10 | loss 3.9000 | lr 1.00e-03 | 1,234 tok/s | eta 0:00:09"


def test_a_worker_appends_to_the_job_log_once_and_only_on_rank_0(monkeypatch, tmp_path):
    """A launcher's worker appends to the driver's dtrain.log; in the process whose job logging
    writes that file already (a one-process run), no second handler writes the same line again."""
    path = tmp_path / "dtrain.log"
    path.write_text("[driver line]\n")
    monkeypatch.setenv(JOB_LOG_ENV, str(path))
    for main in (False, True):
        with job_log(main):
            LOG.info("from rank %d", 0 if main else 1)
    assert path.read_text().splitlines()[0] == "[driver line]"
    assert [line.split(" - ", 1)[1] for line in path.read_text().splitlines()[1:]] == ["from rank 0"]
    driver_handler = logging.FileHandler(path)  # what Hydra's job logging puts on the root logger
    logging.getLogger().addHandler(driver_handler)
    try:
        with job_log(True):
            LOG.warning("once")  # WARNING: the root logger's level here is pytest's, not the job's
    finally:
        logging.getLogger().removeHandler(driver_handler)
        driver_handler.close()
    assert path.read_text().count("once") == 1


@pytest.mark.slow
def test_debug_preset_through_a_pipe_shows_each_step_as_it_goes(data_dir, tmp_path):
    """`dtrain train experiment=debug | cat` with Python's default buffering (no PYTHONUNBUFFERED):
    each logged step is a line the moment it is logged, not all at once at the end; dtrain.log
    holds them."""
    run_dir = tmp_path / "run"
    env = dtrain_env()
    env = paced(env)  # steps slower than a write: the lines must arrive apart, not only be written apart
    env.pop("PYTHONUNBUFFERED", None)
    args = ["train", "experiment=debug", "data=text", "data.name=corpus", f"data.dir={data_dir}",
            *tokenizer_args(data_dir), "train.sample_tokens=0", f"hydra.run.dir={run_dir}",
            "train.val_interval=0"]  # validation at the end only: its line would flush the step lines before it
    with (tmp_path / "stderr.txt").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=err)
        arrived = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
    assert proc.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()
    steps = [(t, m[1]) for t, line in arrived if (m := STEP_LINE.match(line))]
    assert [int(step) for _, step in steps] == [1, 2, 3, 4, 5, 6], arrived
    # between step 1 and 6: five steps and three checkpoints; a block-buffered stdout would deliver
    # every line in one piece at the end
    assert steps[-1][0] - steps[0][0] > 0.5, arrived
    assert [m for m in job_log_messages(run_dir) if STEP_LINE.match(m)] == [line for _, line in arrived
                                                                              if STEP_LINE.match(line)]


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_the_bar_and_no_plain_lines(data_dir, tmp_path):
    """`dtrain train` on a terminal (a real pty): the live bar, no plain step line; dtrain.log still
    holds one line per logged step."""
    run_dir = tmp_path / "run"
    primary, secondary = pty.openpty()
    args = tiny_args(data_dir, run_dir, "train.max_steps=6", "train.progress=true")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=dtrain_env(),
                            stdin=secondary, stdout=secondary, stderr=secondary)
    os.close(secondary)
    shown: list[str] = []
    reader = threading.Thread(target=lambda: shown.append(_read_all(primary)))  # a full pty would block it
    reader.start()
    assert proc.wait(timeout=300) == 0
    reader.join(timeout=30)
    assert "step 6/6" in shown[0] and "tok/s" in shown[0], shown[0]
    assert not re.search(r"step \d+/6 \| loss", shown[0]), shown[0]
    assert [step for step, _ in step_lines(job_log_messages(run_dir))] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_run_logs_val_bpb_beside_val_loss(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=4")
    args[args.index("train.val_interval=0")] = "train.val_interval=2"
    proc = run_dtrain(args, check=True)
    vals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4] and all(0 < r["val_bpb"] < 20 for r in vals)
    assert f"step 4: val loss {vals[-1]['val_loss']:.4f} | val bpb {vals[-1]['val_bpb']:.4f}" in proc.stdout
    summary = read_metrics(run_dir)[-1]["summary"]
    assert summary["final_val_bpb"] == pytest.approx(vals[-1]["val_bpb"])
    assert "final val bpb" in proc.stdout
    report = run_dtrain(["report", str(run_dir), f"--out={tmp_path / 'figures'}"], check=True)
    assert "val bpb" in report.stdout and f"{vals[-1]['val_bpb']:.4f}" in report.stdout  # the results table's column
