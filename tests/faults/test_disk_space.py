"""A full disk caught before the work is lost, on a real small file system (a tmpfs mounted for the
test; skipped, saying why, where mounting is not allowed).

On a disk that holds two and a half checkpoints, a run keeping 3 saves step 4 and step 8 and stops
right after step 8 (the next save could not fit): one `error:` line with the bytes needed and
free, no step trained past the checkpoint. The same command is then one line at the start, writing
nothing. The advice in docs/checkpoints.md, `checkpoint.keep=1`, continues it to the end (the checkpoint that
retention lets go is removed before the next save), with the losses of an uninterrupted run.

A fresh run on a disk with room for its weights and metrics but not for one checkpoint is refused
at the start, before anything is written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers.checkpoints import snapshot
from helpers.dtrain import read_metrics, run_dtrain, tiny_args, train_losses
from helpers.errors import one_line_error

from trainer.checkpoint.layout import list_checkpoints
from trainer.checkpoint.space import folder_bytes

STEPS = 20
ARGS = (f"train.max_steps={STEPS}", "checkpoint.interval=4", "checkpoint.keep=3")


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its disks are sized for
    GPT-2-vocabulary checkpoints."""
    return gpt2_data_dir


@pytest.fixture
def small_disk(tmp_path):
    """Mounts a tmpfs of the size given; unmounted at the end."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_full_disk_stops_after_a_save_and_keep_1_continues(data_dir, small_disk, tmp_path):
    reference = tmp_path / "reference"
    run_dtrain(tiny_args(data_dir, reference, *ARGS), check=True)
    size = folder_bytes(list_checkpoints(reference / "checkpoints")[-1])
    disk = small_disk(int(size * 2.5))
    run_dir = disk / "run"

    stopped = run_dtrain(tiny_args(data_dir, run_dir, *ARGS))
    line = one_line_error(stopped)
    assert "not enough free space for the next checkpoint" in line and "after saving step_000008" in line, line
    need, free = (int(n.replace(",", "")) for n in re.search(r"needs ([\d,]+) bytes, ([\d,]+) are free", line).groups())
    assert free < need and "continue with checkpoint.keep=1" in line, line  # the advice that works here
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_000004", "step_000008"]
    assert max(r["step"] for r in read_metrics(run_dir)) == 8, "trained past the last checkpoint that fit"

    before = snapshot(run_dir)
    again = one_line_error(run_dtrain(tiny_args(data_dir, run_dir, *ARGS)))
    assert "not enough free space" in again and "at the start" in again and "checkpoint.keep=1" in again, again
    assert snapshot(run_dir) == before, "a refused start wrote into the run directory"

    done = run_dtrain(tiny_args(data_dir, run_dir, *ARGS, "checkpoint.keep=1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "removing step_000004 first to make room" in done.stderr, done.stderr[-3000:]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [f"step_{STEPS:06d}"]
    assert train_losses(run_dir) == train_losses(reference)  # bitwise: world 1, CPU


@pytest.mark.slow  # a refused start, but the launch checks import torch and size the model: ~9 s
def test_a_fresh_run_without_room_for_one_checkpoint_writes_nothing(data_dir, small_disk):
    """20 MB of disk: room for the tiny model's 13 MB of weights and for the metrics, not for a
    checkpoint (40 MB: the weights and AdamW's two moments). With the only save at the end
    (checkpoint.interval=0) such a run used to train to the end and lose it all at the save; now it
    is one line at the start, naming the sizes, and nothing is written."""
    disk = small_disk(20 << 20)
    line = one_line_error(run_dtrain(tiny_args(data_dir, disk / "run", "train.max_steps=10")))
    assert "not enough free space for the run's first checkpoint" in line, line
    assert "at the start (nothing written)" in line and "hydra.run.dir=" in line, line
    sizes = re.search(r"take ([\d,]+) bytes .* ([\d,]+) are free", line)
    size, free = (int(n.replace(",", "")) for n in sizes.groups())
    assert size > 3 * 13_000_000 and free < size, line  # the whole checkpoint, not the weights alone
    assert list(disk.iterdir()) == [], "a refused start wrote into the run directory"
