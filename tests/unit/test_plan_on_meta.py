"""The plan's shard counting in one process (trainer/plan/shards.py): a 70B model on the meta device
under a fake world of 64 ranks, with no memory and no process group left behind; replicas; the tp split.
The figures against a real run's live shards: tests/parallel/test_plan_shards.py."""

from __future__ import annotations

import resource

import pytest
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.config.compose import compose
from trainer.config.shape import parameter_count
from trainer.model.gpt import build_model
from trainer.plan.memory import estimate
from trainer.plan.shards import shard_plan

MiB = 1024**2


def plan(*overrides, mode="fsdp", world=4):
    cfg = compose([*overrides, f"parallel={mode}", f"world={world}"])
    return cfg, shard_plan(cfg, mode, world)


def test_a_70b_model_is_counted_on_64_ranks_without_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg, shards = plan("model=llama3_70b", world=64)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 512 * MiB, f"the plan's process grew {grown / MiB:.0f} MiB"  # one real layer is 3.4 GB
    assert not dist.is_initialized()  # the fake world is torn down
    count = parameter_count(cfg.model)
    assert sum(shards.params) == 4 * count  # every element on exactly one rank, fp32
    assert max(shards.params) <= 4 * count / 64 * 1.001
    assert shards.optim_tensors == tuple(2 * p for p in shards.params)  # AdamW: exp_avg and exp_avg_sq
    assert shards.optim_scalars[0] == 4 * (3 + 80 * 6)  # a step counter per tensor: 6 a block, wte, head, norm


def test_replicas_hold_what_one_shard_group_holds():
    _, hsdp = plan("model=llama_tiny", "parallel.dp_replicate=2", mode="hsdp", world=8)
    _, fsdp = plan("model=llama_tiny", world=4)
    assert hsdp.params == fsdp.params * 2  # ranks 0-3 and 4-7: the same four shards
    assert hsdp.optim == fsdp.optim * 2


def test_lion_keeps_one_state_tensor_per_shard_and_muon_its_owners_matrices():
    _, lion = plan("model=tiny", "optim=lion")
    assert lion.optim_tensors == lion.params and lion.muon == 0
    _, adamw = plan("model=llama_tiny")
    _, muon = plan("model=llama_tiny", "optim=muon")
    assert muon.muon > 0 and sum(muon.optim_tensors) < sum(adamw.optim_tensors)  # hidden matrices leave AdamW


def test_tensor_parallel_ranks_split_the_matrices():
    """Under FSDP 4 x TP 2 a block's matrices are split over all 8 ranks, while the embedding, the
    head and the norms are whole on each tp rank (a replicated head), split over the 4 FSDP ranks
    only: each rank holds 1/8 of the one and 1/4 of the other (up to FSDP's row rounding)."""
    cfg, tp = plan("model=llama_tiny", "parallel.tp=2", world=8)
    model = build_model(cfg.model)
    matrices = sum(p.numel() for name, p in model.named_parameters() if ".h." in name and p.dim() == 2)
    rest = sum(p.numel() for p in model.parameters()) - matrices
    expected = 4 * (matrices / 8 + rest / 4)
    assert abs(max(tp.params) / expected - 1) < 0.01, (max(tp.params), expected)


def test_a_process_with_its_own_process_group_is_refused():
    cfg = compose(["model=tiny", "parallel=fsdp", "world=2"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="no process group"):
            shard_plan(cfg, "fsdp", 2)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_splits_the_heads_activations_not_the_residual_stream_or_the_head():
    """dtrain's TP has no sequence parallelism and a replicated head: what a block keeps per head and
    per hidden unit is split over tp, the residual stream and the logits are not. With activation
    checkpointing the blocks keep only their (whole) inputs, so tp=8 saves far less than 8x."""
    cfg = compose(["model=llama3_70b", "parallel=fsdp", "world=64", "train.activation_checkpointing=true",
                   "train.micro_batch_size=1", "train.seq_len=8192", "train.device=cuda", "train.dtype=bfloat16"])
    whole = estimate(cfg, "fsdp", 64, 1, "cuda").activations
    split = estimate(OmegaConf.merge(cfg, {"parallel": {"tp": 8}}), "fsdp", 64, 1, "cuda").activations
    m = cfg.model
    block_inputs = m.n_layer * m.n_embd * 4 * 8192  # fp32 residual stream, one per block
    logits = m.vocab_size * 8192  # at least a byte per logit of the replicated head
    assert split >= block_inputs + logits
    assert whole / 8 < split < whole
