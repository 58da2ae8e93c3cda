"""train.on_nonfinite with the update masked on device (trainer/nonfinite.py): where every optimizer
takes found_inf (fused AdamW, Muon), the update is queued under the device-side verdict and the host
reads it afterwards. The guarantees are those of the host read first (tests/test_nonfinite.py):
skip makes no update (weights, optimizer state, AdamW's step count), every rank agrees, stop saves
nothing after the bad step, and no checkpoint holds a non-finite tensor.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_dtrain, tiny_args
from test_nonfinite import assert_finite_checkpoints, error_lines, inject, steps_of, strict_metrics

from trainer.compose import compose
from trainer.model import build_model
from trainer.optim import build_optimizer, masks_on_device


def test_which_optimizers_mask_on_device():
    for overrides, masks in ((["optim.fused='true'"], True), (["optim=muon", "optim.fused='true'"], True),
                             (["optim.fused='false'"], False), (["optim=muon", "optim.fused='false'"], False)):
        cfg = compose(["model=tiny", *overrides])
        optimizer = build_optimizer(build_model(cfg.model), cfg.optim, torch.device("cpu"))
        assert masks_on_device(optimizer) is masks, overrides


@pytest.mark.slow
def test_skip_masked_on_device_is_the_skip_of_the_host_read(data_dir, tmp_path):
    """ddp at world 2 with Muon and AdamW: fused AdamW masks on device, the plain one makes the host
    read first. Both skip the same steps and train the same model (the two AdamW kernels round
    differently, so within 1e-5)."""
    losses = {}
    for fused in ("true", "false"):
        run_dir = tmp_path / fused
        proc = run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "optim=muon",
                                    f"optim.fused='{fused}'", "optim.muon.weight_decay=0.1", "train.max_steps=8",
                                    "train.log_interval=1", "checkpoint.interval=4", "train.on_nonfinite=skip"),
                          env=inject(3, 4, 6))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        records = strict_metrics(run_dir)
        train = [r for r in records if "loss" in r]
        assert [r["step"] for r in train] == list(range(1, 9))
        assert [r["step"] for r in train if r["loss"] is None] == [3, 4, 6]
        assert records[-1]["summary"]["skipped"] == 3 and steps_of(run_dir) == [4, 8]
        assert_finite_checkpoints(run_dir)
        losses[fused] = {r["step"]: r["loss"] for r in train if r["loss"] is not None}
    assert max(abs(losses["true"][s] - losses["false"][s]) for s in losses["false"]) < 1e-5, losses


def test_stop_masked_on_device_saves_nothing_after_the_bad_step(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "optim=muon", "optim.fused='true'", "train.max_steps=8",
                                "checkpoint.interval=2", "train.log_interval=2"), env=inject(5))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "at step 5" in lines[0] and "step_000004" in lines[0], proc.stderr
    assert steps_of(run_dir) == [2, 4]
    assert_finite_checkpoints(run_dir)
