"""train.memory_snapshot and a CUDA out-of-memory error (issue 48, item 2), on a real GPU: the
snapshot's pickle exists and loads, and an over-sized micro batch ends the run with the one line,
its snapshot, and no checkpoint written. Skipped without a CUDA device (the CPU's refusal of the key:
tests/cli/test_one_line_rule.py; the line's composition: tests/unit/test_out_of_memory.py)."""

from __future__ import annotations

import gzip
import json
import pickle

import pytest
import torch
from helpers.dtrain import args_with, run_dtrain
from helpers.errors import one_line_error

from trainer.checkpoint.layout import latest_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_snapshot_at_the_first_profiled_step(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dtrain(args_with(data_dir, run_dir, "train.max_steps=4", "optim.warmup_steps=2", "train.device=cuda",
                         "train.memory_snapshot=true", "train.profile.steps=[2,3]"), check=True)
    assert sorted(p.name for p in (run_dir / "memory").iterdir()) == ["rank0_step2.pickle"]
    with open(run_dir / "memory" / "rank0_step2.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and snapshot["device_traces"][0]  # the allocator's state and its history
    with gzip.open(run_dir / "profile" / "rank0.json.gz", "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any("gemm" in n.lower() or "kernel" in n.lower() for n in names)  # CUDA kernels in the trace


def test_out_of_memory_is_one_line_with_its_snapshot(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    # a million-word vocabulary: 256 x 64 positions of fp32 logits are 65 GB, three times over
    # (logits, log-softmax, their gradient): more than any one GPU holds
    proc = run_dtrain(args_with(data_dir, run_dir, "train.max_steps=2", "optim.warmup_steps=1", "train.device=cuda",
                                "train.dtype=float32", "model.vocab_size=1000000", "train.micro_batch_size=256",
                                "train.memory_snapshot=true"))
    line = one_line_error(proc)
    snapshot = run_dir / "memory" / "rank0_step1_oom.pickle"
    assert "CUDA out of memory at step 1 on rank 0; peak " in line and str(snapshot) in line, line
    assert "train.micro_batch_size=128" in line and "train.loss_chunks=4" in line
    with open(snapshot, "rb") as f:
        assert pickle.load(f)["segments"]
    assert latest_checkpoint(run_dir) is None  # nothing saved
