"""A continuation is checked against what the run was, caused for real: a stopped `parallel=ddp
world=2` run continued at world 1 changes the global batch (one line naming
train.total_batch_size=<the recorded value>; with it, the losses match the uninterrupted run within
1e-5), data prepared again from other text under a stopped run is one line that trains nothing, and
`dtrain prepare --force` under a live run is refused (a dead run's lock does not block it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import corpus_text, run_dtrain, tiny_args, train_losses
from test_checkpoint import one_line_error, start_dtrain, wait_for
from test_rundir import snapshot
from test_signals import finish, logged

from trainer.checkpoint.layout import list_checkpoints

STEPS = 16
STOP_ARGS = (f"train.max_steps={STEPS}", "checkpoint.interval=0")
DDP = ("parallel=ddp", "world=2")
ONE = ("parallel=none", "world=1")
GLOBAL_BATCH = 4 * 64 * 2  # tiny_args' micro batch x seq len x world 2


def stopped_run(args: list[str], run_dir: Path, log: Path, after_steps: int = 3) -> int:
    """Start `args`, let it log `after_steps` steps, SIGTERM the driver: it saves and exits 143.
    Returns the step it stopped at."""
    proc = start_dtrain(args, log)
    wait_for(lambda: logged(run_dir, at_least=after_steps), proc, log)
    os.kill(proc.pid, signal.SIGTERM)
    text = finish(proc, log)
    assert proc.returncode == 143, text[-3000:]
    (stopped,) = list_checkpoints(run_dir / "checkpoints")
    return int(stopped.name.split("_")[1])


def with_data(args: list[str], name: str) -> list[str]:
    """tiny_args on another prepared dataset (tiny_args' data.dir names its folder)."""
    return [a.replace("data.name=corpus", f"data.name={name}") for a in args]


def prepare_text(root: Path, name: str, source: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_dtrain(["prepare", "data=text", f"data.name={name}", f"data.source={source}", f"data.dir={root}",
                       "data.val_fraction=0.1", *extra])


@pytest.mark.slow
def test_world_change_keeps_the_global_batch_or_says_so(data_dir, tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    run_dtrain(tiny_args(data_dir, reference, *STOP_ARGS, *DDP), check=True)
    stopped_at = stopped_run(tiny_args(data_dir, run_dir, *STOP_ARGS, *DDP), run_dir, tmp_path / "stopped.log")
    before = snapshot(run_dir)

    # the same command at world 1: the global batch would halve; one line naming the recorded total
    refused = run_dtrain(tiny_args(data_dir, run_dir, *STOP_ARGS, *ONE))
    line = one_line_error(refused)
    assert f"train.total_batch_size={GLOBAL_BATCH}" in line, line
    assert f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before, "a refused continuation wrote into the run directory"

    # with the recorded total given, it continues (accumulation 2) and matches the uninterrupted run
    run_dtrain(tiny_args(data_dir, run_dir, *STOP_ARGS, *ONE, f"train.total_batch_size={GLOBAL_BATCH}"), check=True)
    want, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) for s in range(stopped_at + 1, STEPS + 1))
    assert worst < 1e-5, f"continued at world 1 from step {stopped_at}: max |loss - uninterrupted| = {worst:.3g}"
    assert all(got[s] == want[s] for s in range(1, stopped_at + 1))


@pytest.mark.slow
def test_data_prepared_again_from_other_text_is_refused(tmp_path):
    root, source = tmp_path / "data", tmp_path / "notes.txt"
    text = corpus_text()
    source.write_text(text[: len(text) // 2])
    prepare_text(root, "notes", source).check_returncode()
    run_dir = tmp_path / "run"
    args = with_data(tiny_args(root, run_dir, *STOP_ARGS), "notes")
    stopped_run(args, run_dir, tmp_path / "stopped.log")
    before = snapshot(run_dir)

    source.write_text(text[len(text) // 2:])  # edited text, the same settings
    prepared = prepare_text(root, "notes", source, "--force")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    refused = run_dtrain(args)
    line = one_line_error(refused)
    assert "train split" in line and f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before, "the refused continuation trained or wrote"

    # on purpose: resume=PATH continues its checkpoint on the new data
    run_dtrain([*args, f"resume={run_dir}"], check=True)
    assert max(train_losses(run_dir)) == STEPS


@pytest.mark.slow
def test_prepare_force_under_a_live_run_is_refused(tmp_path):
    root, source = tmp_path / "data", tmp_path / "notes.txt"
    source.write_text(corpus_text()[:400_000])
    prepare_text(root, "notes", source).check_returncode()
    manifest = (root / "notes" / "manifest.json").read_bytes()
    run_dir, log = tmp_path / "run", tmp_path / "live.log"
    proc = start_dtrain(with_data(tiny_args(root, run_dir, "train.max_steps=100000"), "notes"), log)
    try:
        wait_for(lambda: logged(run_dir), proc, log)
        refused = prepare_text(root, "notes", source, "--force")
        line = one_line_error(refused)
        assert "in use by a running dtrain run" in line and f"pid {proc.pid}" in line, line
        assert (root / "notes" / "manifest.json").read_bytes() == manifest
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a dead run's lock goes with it
        proc.wait(timeout=60)
    again = prepare_text(root, "notes", source, "--force")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((root / "notes" / "manifest.json").read_text())["created"]
