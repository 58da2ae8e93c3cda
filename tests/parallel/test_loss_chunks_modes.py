"""train.loss_chunks in every parallel mode: a training run with the loss in pieces tracks one
without (tests/unit/test_loss_chunks.py checks the pieces themselves in-process)."""

from __future__ import annotations

import pytest
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.runs import MODES, assert_matches_one_process

STEPS = 10
TOTAL = ["train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={STEPS}", "optim.lr=1e-3"]
# each mode's micro batch on these 256-token steps (accumulation in every mode, as in the references)
MICRO_BATCH = {"none": 4, "dp": 4, "ddp": 2, "zero": 2, "zero_torch": 2, "fsdp": 2}


def in_mode(mode: str) -> list[str]:
    return [*MODES[mode].launch, f"train.micro_batch_size={MICRO_BATCH[mode]}"]


def _losses(data_dir, run_dir, *overrides):
    run_dtrain(tiny_args(data_dir, run_dir, *TOTAL, *overrides), check=True)
    return train_losses(run_dir)


@pytest.fixture(scope="module")
def whole_head(data_dir, module_tmp):
    return _losses(data_dir, module_tmp.mktemp("whole") / "run", *in_mode("none"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MICRO_BATCH))
def test_training_with_loss_chunks_tracks_the_whole_loss(mode, whole_head, data_dir, tmp_path):
    """fsdp (the tied head's weight unsharded in the root unit) is the quick tier's case."""
    got = _losses(data_dir, tmp_path / "run", *in_mode(mode), "train.loss_chunks=4")
    assert_matches_one_process(whole_head, got, STEPS, f"{mode} loss_chunks=4")


# tensor parallelism compiled too: its sequence parallelism's hooks and collectives inside the graph,
# the loss in pieces of each rank's positions. Inductor's default mode: max-autotune's CPU GEMM
# search over the split matrices doubled the test's time (102 s under CI's load), and the other
# modes check that the compile mode is passed on.
TENSOR_PARALLEL = ["parallel=none", "parallel.tp=2", "world=2", "train.micro_batch_size=4"]
AUTOTUNED = ["train.compile_mode=max-autotune-no-cudagraphs"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp", "none_tp2"])
def test_compiled_with_loss_chunks_and_a_compile_mode(mode, whole_head, data_dir, tmp_path):
    launch = TENSOR_PARALLEL if mode == "none_tp2" else [*in_mode(mode), *AUTOTUNED]
    got = _losses(data_dir, tmp_path / "run", *launch, "train.loss_chunks=4", "train.compile=true")
    worst = max(abs(got[s] - whole_head[s]) for s in whole_head)
    assert sorted(got) == list(range(1, STEPS + 1)) and worst < 1e-4, worst  # inductor reorders fp32 sums
