"""train.on_nonfinite with the update masked on device (trainer/fit/nonfinite.py): where every optimizer
takes found_inf (fused AdamW, Muon), the update is queued under the device-side verdict and the host
reads it afterwards. The guarantees are those of the host read first (tests/faults/test_nonfinite.py):
skip makes no update (weights, optimizer state, AdamW's step count), every rank agrees, stop saves
nothing after the bad step, and no checkpoint holds a non-finite tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checkpoints import assert_finite_checkpoints, one_process_optimizer, steps_of, strict_metrics
from helpers.dtrain import inject, run_dtrain, tiny_args
from helpers.errors import error_lines

from trainer.config.compose import compose
from trainer.model.gpt import build_model
from trainer.optim.build import masks_on_device


def test_which_optimizers_mask_on_device():
    for overrides, masks in ((["optim.fused='true'"], True), (["optim=muon", "optim.fused='true'"], True),
                             (["optim.fused='false'"], False), (["optim=muon", "optim.fused='false'"], False)):
        cfg = compose(["model=tiny", *overrides])
        optimizer = one_process_optimizer(build_model(cfg.model), cfg)
        assert masks_on_device(optimizer) is masks, overrides


def skipping_run(data_dir: Path, run_dir: Path, *overrides: str) -> dict[int, float]:
    """Muon + AdamW at world 2, steps 3, 4 and 6 non-finite under on_nonfinite=skip: the losses of
    the other steps, after checking what every skip run shows."""
    proc = run_dtrain(tiny_args(data_dir, run_dir, "world=2", "optim=muon", "optim.muon.weight_decay=0.1",
                                "train.max_steps=8", "train.log_interval=1", "checkpoint.interval=4",
                                "train.on_nonfinite=skip", *overrides), env=inject(3, 4, 6))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = strict_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert [r["step"] for r in train if r["loss"] is None] == [3, 4, 6]
    assert records[-1]["summary"]["skipped"] == 3 and steps_of(run_dir) == [4, 8]
    assert_finite_checkpoints(run_dir)
    return {r["step"]: r["loss"] for r in train if r["loss"] is not None}


@pytest.fixture(scope="module")
def host_read(data_dir, module_tmp):
    """The reference: ddp with the plain AdamW, whose verdict the host reads before the update."""
    return skipping_run(data_dir, module_tmp.mktemp("host_read") / "run", "parallel=ddp", "optim.fused='false'")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero", "zero_torch", "fsdp"])
def test_skip_masked_on_device_is_the_skip_of_the_host_read(mode, host_read, data_dir, tmp_path):
    """Fused AdamW and Muon mask the update on device in every mode that syncs replicas: the same
    steps are skipped and the same model trained as with the host read first (the two AdamW kernels
    round differently, so within 1e-5)."""
    masked = skipping_run(data_dir, tmp_path / "run", f"parallel={mode}", "optim.fused='true'")
    assert max(abs(masked[s] - host_read[s]) for s in host_read) < 1e-5, (masked, host_read)


def test_stop_masked_on_device_saves_nothing_after_the_bad_step(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "optim=muon", "optim.fused='true'", "train.max_steps=8",
                                "checkpoint.interval=2", "train.log_interval=2"), env=inject(5))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "at step 5" in lines[0] and "step_000004" in lines[0], proc.stderr
    assert steps_of(run_dir) == [2, 4]
    assert_finite_checkpoints(run_dir)
