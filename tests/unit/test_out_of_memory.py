"""A step that runs out of device memory (issue 48, item 2): torch's OutOfMemoryError, raised inside
the step's watch, becomes one DeviceOutOfMemory line (a UserError, so a worker's travels to its
driver as that line) naming the step, the peak and the snapshot, with the settings that need less
memory; nothing is written when no history was recording. The CUDA paths themselves:
tests/cli/test_memory_snapshot.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config.compose import compose
from trainer.errors import DeviceOutOfMemory, UserError
from trainer.observe.memory import MemoryRecorder, out_of_memory_line
from trainer.process.runtime import Runtime

CPU = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


def test_out_of_memory_in_a_step_is_one_line(tmp_path):
    recorder = MemoryRecorder(compose(["model=tiny", "train.micro_batch_size=16"]), CPU, tmp_path, dump_step=1)
    with pytest.raises(DeviceOutOfMemory) as caught, recorder.watch(7):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
    line = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in line
    assert line.startswith("CUDA out of memory at step 7 on rank 0;")
    assert "train.memory_snapshot=true records one" in line  # no history was recording: no file
    for fix in ("train.micro_batch_size=8", "train.loss_chunks=4", "train.activation_checkpointing=true",
                "parallel=fsdp", "dtrain plan"):
        assert fix in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_other_errors_pass_through(tmp_path):
    recorder = MemoryRecorder(compose(["model=tiny"]), CPU, tmp_path, dump_step=1)
    with pytest.raises(RuntimeError, match="not memory"), recorder.watch(3):
        raise RuntimeError("not memory")


def test_the_line_names_the_snapshot_and_peak_and_only_the_fixes_not_taken():
    cfg = compose(["model=tiny", "parallel=fsdp", "train.micro_batch_size=1", "train.loss_chunks=8",
                   "train.activation_checkpointing=true"])
    line = out_of_memory_line(cfg, 12, 3, peak=3 * 2**30, total=80 * 2**30,
                              snapshot=Path("run/memory/rank3_step12_oom.pickle"))
    assert "at step 12 on rank 3; peak 3.00 GiB allocated of 80.00 GiB" in line
    assert "snapshot run/memory/rank3_step12_oom.pickle (open it at https://pytorch.org/memory_viz)" in line
    assert "micro_batch_size" not in line and "loss_chunks" not in line and "activation_checkpointing" not in line
    assert "a larger world (more shards)" in line
