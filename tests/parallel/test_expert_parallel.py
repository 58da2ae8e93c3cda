"""parallel.ep: a mixture of experts' experts split over data-parallel ranks, tokens exchanged
all-to-all (trainer/parallel/expert_parallel.py).

On test_parity's 256-token reference steps with model=qwen3_moe_tiny (8 experts, top 2): ep 2 at
world 2, FSDP 2 x ep 2, HSDP 2 x ep 2 and ep 2 x tp 2 at world 4, and a MoE model under tp 2
alone, track the one-process losses within 1e-5
(dropless routing: the split changes only the order of sums). The ep 2 run saves checkpoints: killed
with -9 past one, the same command continues it bitwise, and its checkpoint continues under
parallel=none and fsdp without ep within 1e-5. Sizes no run can lay out are one line.
"""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import assert_continues_bitwise, assert_continues_within
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.errors import error_line
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import (
    ONE_PROCESS,
    REFERENCE_BATCH,
    REFERENCE_STEPS,
    assert_matches_one_process,
)

from trainer.parallel.expert_parallel import _by_expert

MOE = "model=qwen3_moe_tiny"
CHECKPOINTED = "checkpoint.interval=4"  # the kill -9 and reshard tests' reference saves
# micro batch 2 x 32 tokens x data-parallel ranks x accumulation = 256
CASES = {
    "reference": ONE_PROCESS,
    "ep2": ["parallel=fsdp", "parallel.ep=2", "world=2", "train.micro_batch_size=2", CHECKPOINTED],
    "fsdp2_ep2": ["parallel=fsdp", "parallel.ep=2", "world=4", "train.micro_batch_size=2"],
    "hsdp2_ep2": ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.ep=2", "world=4",
                  "train.micro_batch_size=2"],
    # the attention split over tp 2, the experts over ep 2 (whole on each tp rank)
    "ep2_tp2": ["parallel=fsdp", "parallel.ep=2", "parallel.tp=2", "world=4", "train.micro_batch_size=2"],
    "tp2": ["parallel=none", "parallel.tp=2", "world=2", "train.micro_batch_size=2"],
}


def _args(case: str) -> tuple[str, ...]:
    return (*REFERENCE_BATCH, MOE, *CASES[case])


@pytest.fixture(scope="module")
def runs(shared_run):
    """case -> the session's run dir."""
    return lambda case: shared_run(*_args(case))[0]


def test_arrived_rows_are_regrouped_by_expert_sources_in_order():
    # 2 source ranks x 2 local experts: source 0 sent 1 row for expert 0 and 2 for expert 1, source 1
    # sent 2 for expert 0 and none for expert 1; rows arrive [s0e0 | s0e1 s0e1 | s1e0 s1e0]
    counts_in = torch.tensor([[1, 2], [2, 0]])
    assert _by_expert(counts_in).tolist() == [0, 3, 4, 1, 2]


@pytest.mark.parametrize("case", [
    "ep2",
    pytest.param("fsdp2_ep2", marks=pytest.mark.slow),
    pytest.param("hsdp2_ep2", marks=pytest.mark.slow),
    pytest.param("ep2_tp2", marks=pytest.mark.slow),
    pytest.param("tp2", marks=pytest.mark.slow),
])
def test_losses_match_one_process(case, runs):
    assert_matches_one_process(train_losses(runs("reference")), train_losses(runs(case)), REFERENCE_STEPS, case)


@pytest.mark.slow
def test_kill_9_under_ep_then_the_same_command_is_bitwise(data_dir, runs, tmp_path):
    reference = runs("ep2")
    run_dir, log = tmp_path / "run", tmp_path / "killed.log"
    args = tiny_args(data_dir, run_dir, *_args("ep2"))
    assert kill_past_a_checkpoint(args, run_dir, log) < REFERENCE_STEPS
    assert_continues_bitwise(args, run_dir, reference)


# Layouts without ep reading the same micro batches of 2 sequences: the load-balancing loss is
# computed per micro batch (as Hugging Face's per forward), so another micro batch size is another
# objective (one process at micro batch 4 drifts 2.6e-4 from micro batch 2 in 16 steps: measured).
SAME_MICRO_BATCHES = {
    "fsdp_w2": ["parallel=fsdp", "world=2", "train.micro_batch_size=2"],
    "none": ONE_PROCESS,
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SAME_MICRO_BATCHES.values()), ids=list(SAME_MICRO_BATCHES))
def test_an_ep_checkpoint_continues_without_expert_parallelism(data_dir, runs, tmp_path, layout):
    """parallel.ep is a layout key: resumed at step 8 with the same global batch, the rest of the run
    tracks the uninterrupted ep 2 run within 1e-5."""
    step = 8  # the oldest checkpoint the run keeps (checkpoint.keep=3 of 4, 8, 12, 16)
    run_dir = tmp_path / "resharded"
    args = tiny_args(data_dir, run_dir, *REFERENCE_BATCH, MOE, *layout)
    assert_continues_within(runs("ep2"), step, args, run_dir)


# Sizes no run can lay out -> (overrides, a phrase the line must hold); qwen3_moe_tiny has 8 experts.
BAD_SPLITS = {
    "ep with ddp": ([MOE, "parallel=ddp", "parallel.ep=2", "world=2"], "use parallel=fsdp parallel.ep=2"),
    "ep does not divide the experts": ([MOE, "parallel=fsdp", "parallel.ep=3", "world=3"],
                                       "does not divide model.moe.num_experts=8"),
    "ep does not divide dp_shard": ([MOE, "parallel=fsdp", "parallel.ep=4", "world=2"],
                                    "is not a multiple of 4"),
    "ep on a dense model": (["model=llama_tiny", "parallel=fsdp", "parallel.ep=2", "world=2"], "this model is dense"),
    "ep with muon": ([MOE, "optim=muon", "parallel=fsdp", "parallel.ep=2", "world=2"], "use optim=adamw"),
    "ep with cp": ([MOE, "parallel=fsdp", "parallel.ep=2", "parallel.cp=2", "world=4"], "use parallel.cp=1"),
}


@pytest.mark.parametrize("case", list(BAD_SPLITS))
def test_a_bad_expert_split_is_one_line_and_writes_nothing(case, data_dir, tmp_path):
    overrides, needle = BAD_SPLITS[case]
    run = tmp_path / "run"
    assert needle in error_line(run_dtrain(tiny_args(data_dir, run, *overrides)))
    assert not run.exists()


def test_plan_refuses_a_bad_expert_split_the_same_way(tmp_path):
    overrides, needle = BAD_SPLITS["ep does not divide the experts"]
    assert needle in error_line(run_dtrain(["plan", *overrides], cwd=tmp_path))
    assert not any(tmp_path.iterdir())
