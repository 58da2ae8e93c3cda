"""Every mode reads the same tokens per optimizer step and must track single-process losses.

CPU, fp32, fixed seed, the same global batch (256 tokens per step) and data: the loss after each
of 16 optimizer steps agrees with the single-process run to within 1e-5, for real gloo workers
launched through torchrun's engine by `dtrain train`.
"""

from __future__ import annotations

import re

import pytest
from helpers.dtrain import train_losses
from helpers.runs import REFERENCE_BATCH, REFERENCE_STEPS, on_reference_steps

STEPS = REFERENCE_STEPS

# name -> overrides; micro batch x 32 x world x accumulation = 256 tokens in every case
CASES = {  # the quick tier (make test) runs one case per mode
    "none_accum1": on_reference_steps("none"),
    "none_accum2": ["parallel=none", "train.micro_batch_size=4"],
    "dp": on_reference_steps("dp"),
    "ddp_w2": on_reference_steps("ddp"),
    "ddp_w2_accum2": ["parallel=ddp", "world=2", "train.micro_batch_size=2"],
    "ddp_w4": ["parallel=ddp", "world=4", "train.micro_batch_size=2"],
    "ddp_w4_accum2": ["parallel=ddp", "world=4", "train.micro_batch_size=1"],
    "zero_w2": on_reference_steps("zero"),
    "zero_torch_w2": on_reference_steps("zero_torch"),
    "fsdp_w2": on_reference_steps("fsdp"),
    "fsdp_w4": ["parallel=fsdp", "world=4", "train.micro_batch_size=2"],
    "hsdp_2x2_accum2": on_reference_steps("hsdp"),
}
SLOW = {"none_accum2", "ddp_w2_accum2", "ddp_w4", "ddp_w4_accum2", "fsdp_w4", "hsdp_2x2_accum2"}


def train(shared_run, overrides):
    """The session's run of `overrides` on the reference's batches (test_compat checks the same runs)."""
    run_dir, _ = shared_run(*REFERENCE_BATCH, *overrides)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_reference_loss_falls(adamw_reference):
    """The single process with accumulation 4 (micro batch 2), shared with test_muon."""
    assert adamw_reference[STEPS] < adamw_reference[1] - 0.3


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_losses_match_single_process(case, shared_run, adamw_reference):
    losses = train(shared_run, CASES[case])
    worst = max(abs(losses[s] - adamw_reference[s]) for s in adamw_reference)
    assert worst < 1e-5, f"{case}: max |loss - single| = {worst:.3g}"


@pytest.mark.parametrize("case", [c for c in CASES if c not in SLOW])
def test_a_mode_prints_no_library_warning(case, shared_run):
    """What a user sees of a run in each mode holds dtrain's lines only: no torch FutureWarning
    (torch 2.13 deprecates names the floor torch still needs: trainer/parallel/collectives.py)."""
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *CASES[case])
    output = stdout + run_dir.with_suffix(".stderr").read_text()
    assert not re.findall(r"^.*\b\w*Warning\b.*$", output, re.M), output
