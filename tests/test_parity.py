"""Every mode reads the same tokens per optimizer step and must track single-process losses.

CPU, fp32, fixed seed, the same global batch (256 tokens per step) and data: the loss after each
of 20 optimizer steps agrees with the single-process run to within 1e-5, for real gloo workers
launched through torchrun's engine by `dtrain train`.
"""

from __future__ import annotations

import pytest
from conftest import run_dtrain, tiny_args, train_losses

STEPS = 20
TOTAL = ["train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={STEPS}", "optim.lr=1e-3"]

# name -> overrides; micro batch x 32 x world x accumulation = 256 tokens in every case
CASES = {
    "none_accum1": ["parallel=none", "train.micro_batch_size=8"],
    "none_accum2": ["parallel=none", "train.micro_batch_size=4"],
    "dp": ["parallel=dp", "train.micro_batch_size=4"],
    "ddp_w2": ["parallel=ddp", "world=2", "train.micro_batch_size=4"],
    "ddp_w2_accum2": ["parallel=ddp", "world=2", "train.micro_batch_size=2"],
    "ddp_w4": ["parallel=ddp", "world=4", "train.micro_batch_size=2"],
    "ddp_w4_accum2": ["parallel=ddp", "world=4", "train.micro_batch_size=1"],
    "zero_w2": ["parallel=zero", "world=2", "train.micro_batch_size=2"],
    "zero_torch_w2": ["parallel=zero_torch", "world=2", "train.micro_batch_size=2"],
    "fsdp_w2": ["parallel=fsdp", "world=2", "train.micro_batch_size=2"],
    "fsdp_w4": ["parallel=fsdp", "world=4", "train.micro_batch_size=2"],
}


def train(data_dir, run_dir, overrides):
    run_dtrain(tiny_args(data_dir, run_dir, *TOTAL, *overrides), check=True)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """Single process with accumulation 4 (micro batch 2)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    return train(data_dir, run_dir, ["parallel=none", "train.micro_batch_size=2"])


def test_reference_loss_falls(reference):
    assert reference[STEPS] < reference[1] - 0.3


@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_single_process(case, data_dir, tmp_path, reference):
    losses = train(data_dir, tmp_path / "run", CASES[case])
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst < 1e-5, f"{case}: max |loss - single| = {worst:.3g}"
