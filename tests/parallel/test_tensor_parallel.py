"""parallel.tp: each block's matrices split over tensor-parallel ranks (trainer/parallel/tensor_parallel.py).

The same 256-token reference steps as test_parity: `parallel=none parallel.tp=2` (world 2, one
data-parallel rank) and `parallel=fsdp parallel.tp=2` (world 4: FSDP over 2 data-parallel ranks,
TP 2 inside each) track the one-process losses within 1e-5, for GPT-2 blocks (fused [q | k | v],
biases, a tied head) and Llama blocks (GQA: 4 query and 2 KV heads, SwiGLU's fused [gate | up]);
Lion does too under FSDP x TP, and Muon under FSDP x TP and under 1-D TP (whose checkpoint's
momenta continue under parallel=none).
The FSDP x TP run of GPT-2 blocks saves checkpoints: killed with -9 past one, the same command
continues it bitwise.
"""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import assert_continues_bitwise, assert_continues_within
from helpers.dtrain import tiny_args, train_losses
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import (
    MUON_BATCH,
    ONE_PROCESS,
    PLAIN_LAYOUTS,
    REFERENCE_BATCH,
    REFERENCE_STEPS,
    assert_matches_one_process,
)

from trainer.parallel.tensor_parallel import group_rows, ungroup_rows

STEPS = REFERENCE_STEPS
CHECKPOINTED = "checkpoint.interval=4"  # the tensor-parallel runs save: the kill -9 test's reference
# micro batch x 32 tokens x data-parallel ranks x accumulation = 256
CASES = {
    "reference": ONE_PROCESS,
    "none_tp2": ["parallel=none", "parallel.tp=2", "world=2", "train.micro_batch_size=2"],
    "fsdp_tp2": ["parallel=fsdp", "parallel.tp=2", "world=4", "train.micro_batch_size=2"],
    # 3-D: 2 replicas x 2 shards x TP 2, eight processes on the machine's cores (~35 s here)
    "hsdp_tp2": ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.tp=2", "world=8", "train.micro_batch_size=2"],
}
LLAMA = "model=llama_tiny"
# test_lion's batch (its reference run is shared)
LION = ["optim=lion", *(arg for arg in REFERENCE_BATCH if not arg.startswith("optim.lr=")), "optim.lr=3e-4",
        CHECKPOINTED]


def _args(model: str, case: str, optimizer: str = "adamw") -> tuple[str, ...]:
    """The overrides of one run: test_parity's AdamW reference is the one-process run of AdamW."""
    if optimizer == "lion":
        batch = LION
    else:
        batch = REFERENCE_BATCH if case == "reference" else [*REFERENCE_BATCH, CHECKPOINTED]
    return (*batch, *CASES[case], *([LLAMA] if model == "llama" else []))


@pytest.fixture(scope="module")
def runs(shared_run):
    """(model, case, optimizer) -> the session's run dir."""
    return lambda *key: shared_run(*_args(*key))[0]


def test_group_rows_puts_each_ranks_rows_of_every_part_together():
    q, k, v = torch.arange(8.0), 100 + torch.arange(4.0), 200 + torch.arange(4.0)
    grouped = group_rows(torch.cat([q, k, v]), (8, 4, 4), tp=2)
    assert grouped.tolist() == [*q[:4], *k[:2], *v[:2], *q[4:], *k[2:], *v[2:]]
    assert torch.equal(ungroup_rows(grouped, (8, 4, 4), tp=2), torch.cat([q, k, v]))


# The quick tier (make test) runs GPT-2 blocks under 1-D TP only; each case is one launch of its own.
@pytest.mark.parametrize(("model", "case"), [
    ("gpt2", "none_tp2"),
    *(pytest.param(model, case, marks=pytest.mark.slow)
      for model, case in (("llama", "none_tp2"), ("gpt2", "fsdp_tp2"), ("llama", "fsdp_tp2"), ("gpt2", "hsdp_tp2"))),
])
def test_losses_match_one_process(model, case, runs):
    reference = train_losses(runs(model, "reference"))
    assert_matches_one_process(reference, train_losses(runs(model, case)), STEPS, f"{model} {case}")


@pytest.mark.slow
def test_lion_under_fsdp_x_tp_matches_one_process(runs):
    reference = train_losses(runs("gpt2", "reference", "lion"))
    assert_matches_one_process(reference, train_losses(runs("gpt2", "fsdp_tp2", "lion")), STEPS, "lion fsdp_tp2")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp_tp2", "none_tp2"])
def test_muon_under_tp_matches_one_process(case, shared_run):
    """Each hidden matrix gathered whole over the mesh (2 x 2 under fsdp; the 2 tp ranks under none),
    its [q | k | v] rows in the model's order, orthogonalized on its owner, and the update cut back
    by the placements (trainer/parallel/muon_owners.py); test_muon's one-process Muon run is the
    reference. The none_tp2 run saves checkpoints (MUON_BATCH): Muon's momenta by name, by owner."""
    reference = train_losses(shared_run(*MUON_BATCH, *ONE_PROCESS)[0])
    got = train_losses(shared_run(*MUON_BATCH, *CASES[case])[0])
    assert_matches_one_process(reference, got, STEPS, f"muon {case}")


@pytest.mark.slow
def test_a_muon_tp_checkpoint_continues_without_tp(data_dir, shared_run, tmp_path):
    """The owners' whole momenta, saved by name under parallel=none parallel.tp=2, load into one
    process's Muon: resumed at step 8, the rest tracks the uninterrupted TP run within 1e-5."""
    source = shared_run(*MUON_BATCH, *CASES["none_tp2"])[0]
    run_dir = tmp_path / "resharded"
    args = tiny_args(data_dir, run_dir, *MUON_BATCH, *PLAIN_LAYOUTS["none"])
    assert_continues_within(source, 8, args, run_dir)


@pytest.mark.slow
def test_kill_9_under_fsdp_x_tp_then_the_same_command_is_bitwise(data_dir, runs, tmp_path):
    """The DTensor shards of weights and AdamW state (2-D: data-parallel x tensor-parallel) come
    back from the newest checkpoint: the same command ends with the uninterrupted run's losses,
    grad norms and weights."""
    reference = runs("gpt2", "fsdp_tp2")
    run_dir, log = tmp_path / "run", tmp_path / "killed.log"
    args = tiny_args(data_dir, run_dir, *_args("gpt2", "fsdp_tp2"))
    assert kill_past_a_checkpoint(args, run_dir, log) < STEPS
    assert_continues_bitwise(args, run_dir, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PLAIN_LAYOUTS.values()), ids=list(PLAIN_LAYOUTS))
def test_an_fsdp_x_tp_checkpoint_continues_under_another_layout(data_dir, runs, tmp_path, layout):
    """The FSDP x TP checkpoint (world 4, 2 data-parallel ranks) holds its fused rows in the model's
    own [q | k | v] order, so another mesh reads it: resumed at step 8 with the same global batch,
    the rest of the run tracks the uninterrupted FSDP x TP run within 1e-5."""
    source = runs("gpt2", "fsdp_tp2")
    step = 8  # the oldest checkpoint the run keeps (checkpoint.keep=3 of 4, 8, 12, 16)
    run_dir = tmp_path / "resharded"
    assert_continues_within(source, step, tiny_args(data_dir, run_dir, *REFERENCE_BATCH, *layout), run_dir)
