"""parallel.cp: each sequence split over context-parallel ranks (trainer/parallel/context_parallel.py).

First the attention itself, in fp64 on two gloo ranks: a GPT's loss, gradients (averaged over the
group) and validation's per-token losses over the split sequences equal those over whole sequences,
for GPT-2 blocks (a learned position table) and Llama blocks (rotary positions, GQA), with
activation checkpointing and the chunked loss too.

Then training, on test_parity's 256-token reference steps: FSDP over the cp ranks (world 2), FSDP
2 x cp 2 and HSDP 2 x cp 2 (world 4), cp 2 x tp 2 (world 4) and cp 4 track the one-process losses
within 1e-5, and so do Llama blocks and Muon. The FSDP 2 x cp 2 run saves checkpoints: killed with
-9 past one, the same command continues it bitwise, and its checkpoint continues under layouts
without context parallelism within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import assert_continues_bitwise, assert_continues_within
from helpers.dist_workers import every_rank, sequence_split_differences
from helpers.dtrain import read_metrics, tiny_args, train_losses
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import (
    MUON_BATCH,
    ONE_PROCESS,
    PLAIN_LAYOUTS,
    REFERENCE_BATCH,
    REFERENCE_STEPS,
    assert_matches_one_process,
)

from trainer.parallel.context_parallel import SequenceSplit

STEPS = REFERENCE_STEPS
CHECKPOINTED = "checkpoint.interval=4"  # the kill -9 and reshard tests' reference saves
VALIDATED = "train.val_interval=8"  # validation's per-token losses gathered over the group, twice
# micro batch 2 x 32 tokens x data-parallel ranks x accumulation = 256
CASES = {
    "reference": ONE_PROCESS,
    "fsdp_cp2": ["parallel=fsdp", "parallel.cp=2", "world=2", "train.micro_batch_size=2"],
    "fsdp_cp4": ["parallel=fsdp", "parallel.cp=4", "world=4", "train.micro_batch_size=2"],
    "fsdp_dp2_cp2": ["parallel=fsdp", "parallel.cp=2", "world=4", "train.micro_batch_size=2", CHECKPOINTED],
    "hsdp_cp2": ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.cp=2", "world=4", "train.micro_batch_size=2"],
    "fsdp_cp2_tp2": ["parallel=fsdp", "parallel.cp=2", "parallel.tp=2", "world=4", "train.micro_batch_size=2"],
}
LLAMA = "model=llama_tiny"
GPT2_BLOCKS = dict(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_embd=32)
LLAMA_BLOCKS = dict(GPT2_BLOCKS, n_kv_head=2, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    tie_embeddings=False)


def _args(model: str, case: str) -> tuple[str, ...]:
    return (*REFERENCE_BATCH, VALIDATED, *CASES[case], *([LLAMA] if model == "llama" else []))


@pytest.fixture(scope="module")
def runs(shared_run):
    """(model, case) -> the session's run dir."""
    return lambda model, case: shared_run(*_args(model, case))[0]


def _val_losses(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["val_loss"], r["val_bpb"]) for r in read_metrics(run_dir) if "val_loss" in r}


@pytest.mark.parametrize("size", [2, 4])
def test_the_split_gives_every_rank_an_early_and_a_late_chunk_of_equal_work(size):
    seq_len = 8 * size
    shares = [SequenceSplit(None, rank, size).positions(seq_len, torch.device("cpu")) for rank in range(size)]
    assert sorted(torch.cat(shares).tolist()) == list(range(seq_len))
    # a query at position p attends to p + 1 keys: every rank computes as many query-key pairs
    assert len({int((share + 1).sum()) for share in shares}) == 1
    assert shares[0].tolist() == [*range(4), *range(seq_len - 4, seq_len)]


@pytest.mark.parametrize(("blocks", "activation_checkpointing", "loss_chunks"), [
    (GPT2_BLOCKS, False, 1),
    (LLAMA_BLOCKS, True, 2),
], ids=["gpt2", "llama_checkpointed_chunked"])
def test_split_sequences_compute_the_whole_sequences_loss_and_gradients(blocks, activation_checkpointing,
                                                                        loss_chunks, tmp_path):
    ranks = every_rank(sequence_split_differences, 2, blocks, activation_checkpointing, loss_chunks)
    # fp64 throughout but the cross-entropy, which the model computes in fp32 (and the chunked
    # loss's pieces of logits): the loss agrees to fp32's rounding, the gradients to fp64's unchunked
    grads = 1e-12 if loss_chunks == 1 else 1e-6
    for rank, worst in ranks.items():
        assert worst["loss"] < 1e-6 and worst["per_token"] < 1e-6, (rank, worst)
        assert worst["grads"] < grads, (rank, worst)


# The quick tier runs GPT-2 blocks under FSDP over the two cp ranks; each case is one launch.
@pytest.mark.parametrize(("model", "case"), [
    ("gpt2", "fsdp_cp2"),
    *(pytest.param(model, case, marks=pytest.mark.slow)
      for model, case in (("llama", "fsdp_cp2"), ("gpt2", "fsdp_cp4"), ("gpt2", "fsdp_dp2_cp2"),
                          ("gpt2", "hsdp_cp2"), ("llama", "fsdp_cp2_tp2"))),
])
def test_losses_match_one_process(model, case, runs):
    reference, got = runs(model, "reference"), runs(model, case)
    assert_matches_one_process(train_losses(reference), train_losses(got), STEPS, f"{model} {case}")
    want, val = _val_losses(reference), _val_losses(got)
    assert sorted(val) == sorted(want) == [8, 16]
    for step, (loss, bpb) in val.items():
        assert abs(loss - want[step][0]) < 1e-5 and abs(bpb - want[step][1]) < 1e-5, (step, val, want)


@pytest.mark.slow
def test_muon_over_the_cp_ranks_matches_one_process(shared_run):
    """Muon's owners are the ranks FSDP shards over (dp_shard x cp): test_muon's one-process run is the
    reference."""
    reference = train_losses(shared_run(*MUON_BATCH, *ONE_PROCESS)[0])
    got = train_losses(shared_run(*MUON_BATCH, *CASES["fsdp_cp2"])[0])
    assert_matches_one_process(reference, got, STEPS, "muon fsdp_cp2")


@pytest.mark.slow
def test_kill_9_under_fsdp_x_cp_then_the_same_command_is_bitwise(data_dir, runs, tmp_path):
    reference = runs("gpt2", "fsdp_dp2_cp2")
    run_dir, log = tmp_path / "run", tmp_path / "killed.log"
    args = tiny_args(data_dir, run_dir, *_args("gpt2", "fsdp_dp2_cp2"))
    assert kill_past_a_checkpoint(args, run_dir, log) < STEPS
    assert_continues_bitwise(args, run_dir, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PLAIN_LAYOUTS.values()), ids=list(PLAIN_LAYOUTS))
def test_an_fsdp_x_cp_checkpoint_continues_without_context_parallelism(data_dir, runs, tmp_path, layout):
    """parallel.cp is a layout key: resumed at step 8 with the same global batch, the rest of the run
    tracks the uninterrupted FSDP 2 x cp 2 run within 1e-5."""
    source = runs("gpt2", "fsdp_dp2_cp2")
    step = 8  # the oldest checkpoint the run keeps (checkpoint.keep=3 of 4, 8, 12, 16)
    run_dir = tmp_path / "resharded"
    assert_continues_within(source, step, tiny_args(data_dir, run_dir, *REFERENCE_BATCH, *layout), run_dir)
