"""The plan's shard counting in one process (trainer/plan/shards.py): a 70B model on the meta device
under a fake world of 64 ranks, with no memory and no process group left behind; replicas; the tp split.
The figures against a real run's live shards: tests/parallel/test_plan_shards.py."""

from __future__ import annotations

import resource

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.config.compose import compose
from trainer.config.shape import parameter_count
from trainer.parallel.fsdp import FSDPStrategy
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


def test_tensor_parallel_ranks_split_the_matrices(monkeypatch):
    # Whether wrap splits layers itself or the split is estimated, 8 ranks of dp 4 x tp 2 hold what
    # 8 data-parallel ranks do, give or take the norms (whole on each tp rank) and rounding; a tp
    # group holding whole matrices would hold twice that.
    monkeypatch.setattr(FSDPStrategy, "tensor_parallel", True)
    _, tp = plan("model=llama_tiny", "parallel.tp=2", world=8)
    _, dp = plan("model=llama_tiny", world=8)
    assert abs(max(tp.params) / max(dp.params) - 1) < 0.02


def test_a_process_with_its_own_process_group_is_refused():
    cfg = compose(["model=tiny", "parallel=fsdp", "world=2"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="no process group"):
            shard_plan(cfg, "fsdp", 2)
    finally:
        dist.destroy_process_group()
