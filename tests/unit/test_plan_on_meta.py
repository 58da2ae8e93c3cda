"""The plan's shard counting in one process (trainer/plan/shards.py): a 70B model on the meta device
under a fake world of 64 ranks, with no memory and no process group left behind; replicas; the tp split;
Muon's state against the mode's own owner-rank optimizer, built on every rank of a fake world.
The figures against a real run's live shards: tests/parallel/test_plan_shards.py."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.config.batch import mesh_shape
from trainer.config.compose import compose
from trainer.config.shape import parameter_count
from trainer.model.config import GPTConfig
from trainer.model.gpt import build_model
from trainer.optim.build import build_optimizer, parts
from trainer.parallel import STRATEGIES
from trainer.plan.memory import estimate
from trainer.plan.meta import meta_model
from trainer.plan.shards import _MetaStaysMeta, shard_plan
from trainer.process.runtime import Runtime

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


@pytest.mark.parametrize(("checkpointing", "saves_at_least"), [(True, 7), (False, 4.5)])
def test_tensor_parallel_splits_the_activations_by_head_and_by_position(checkpointing, saves_at_least):
    """Under tp with its sequence parallelism each rank keeps 1/tp of the per-head and per-hidden-unit
    tensors and 1/tp of the residual stream's (the checkpointed block inputs, the head's logits); only
    the gathered inputs of each block's column-wise matrices (2 x n_embd a token) stay whole. With
    activation checkpointing (the inputs, and one block rebuilt at a time) tp=8 saves nearly 8x;
    without, every block's gathered inputs keep it near 5x."""
    cfg = compose(["model=llama3_70b", "parallel=fsdp", "world=64", f"train.activation_checkpointing={checkpointing}",
                   "train.micro_batch_size=1", "train.seq_len=8192", "train.device=cuda", "train.dtype=bfloat16"])
    whole = estimate(cfg, "fsdp", 64, 1, "cuda").activations
    split = estimate(OmegaConf.merge(cfg, {"parallel": {"tp": 8}}), "fsdp", 64, 1, "cuda").activations
    m = cfg.model
    gathered = 2 * m.n_embd * 2 * 8192 * (1 if checkpointing else m.n_layer)  # bf16, whole on every rank
    assert split > gathered + m.vocab_size * 8192 / 8  # and at least a byte per logit of the rank's positions
    assert saves_at_least < whole / split < 8, whole / split


def test_muon_under_fsdp_x_tp_counts_its_blocks_exchange_not_every_update_on_every_rank():
    """70B on 64 ranks (fsdp 8 x tp 8) with Muon: each rank sends its block of every matrix to the
    owner and gets its block of the update back (trainer/parallel/muon_owners.py), so the step's
    buffers are about the busiest owner's matrices, not all 70B's hidden matrices in fp32 (~276 GiB
    when every owner's update reached every rank), and micro batch 1 at seq 8192 fits 80 GB."""
    cfg = compose(["model=llama3_70b", "parallel=fsdp", "parallel.tp=8", "world=64", "optim=muon",
                   "train.activation_checkpointing=true", "train.micro_batch_size=1", "train.seq_len=8192",
                   "train.device=cuda", "train.dtype=bfloat16"])
    est = estimate(cfg, "fsdp", 64, 1, "cuda")
    # whole gradients and the received blocks of the owner's matrices, its blocks sent, Newton-Schulz's
    # temporaries: below twice what the owner keeps (its momenta and work copies)
    assert est.temporaries < 2 * est.optim
    assert est.total < 80 * 1024**3


def owned_muon_bytes(cfg, mode: str, world: int) -> list[int]:
    """What the mode's own Muon by owner (trainer/parallel/muon_owners.py OwnedMuon, as the run's
    build_optimizer makes it) keeps on each rank: its owned matrices' momenta (its checkpoint
    template, the state its first step makes) and the zeroed whole copies it steps them on. Built on
    the meta model under a fake world playing each rank in turn."""
    shape = mesh_shape(cfg, world)
    kept = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            runtime = Runtime(rank=rank, local_rank=rank, world=world, local_world=world,
                              device=torch.device("cpu"), distributed=True, shape=shape)
            strategy = STRATEGIES[mode](cfg.parallel, cfg.train, runtime)
            with _MetaStaysMeta():
                model = strategy.wrap(meta_model(GPTConfig.from_cfg(cfg.model)))
            optimizer = build_optimizer(model, cfg.optim, strategy)
            muon = next(part for part in parts(optimizer) if getattr(part, "saves_by_name", False))
            momenta = [t for state in muon.state_template().values() for t in state.values()]
            kept.append(4 * sum(t.numel() for t in [*momenta, *muon.work]))
        finally:
            dist.destroy_process_group()
    return kept


# Muon by owner rank under tensor parallelism and replicas: the owners are every tp rank (none), every
# rank (fsdp x tp), or one replica's shard group (hsdp; hsdp x tp: its shard x tp ranks), never one rank
# stepping them all.
MUON_LAYOUTS = {
    "none_tp2": ("none", 2, ["parallel.tp=2"]),
    # (at tp 2 half the matrices' momenta and work copies happen to be all the momenta: not at 4)
    "none_tp4": ("none", 4, ["parallel.tp=4", "model.n_kv_head=4"]),
    "fsdp2_tp2": ("fsdp", 4, ["parallel.tp=2"]),
    "hsdp2x2": ("hsdp", 4, ["parallel.dp_replicate=2"]),
    "hsdp2x2_tp2": ("hsdp", 8, ["parallel.dp_replicate=2", "parallel.tp=2"]),
    "hsdp2x2_cp2": ("hsdp", 8, ["parallel.dp_replicate=2", "parallel.cp=2"]),  # cp folded into the shard group
}


@pytest.mark.parametrize("layout", MUON_LAYOUTS)
def test_the_plans_muon_state_is_what_its_busiest_owner_keeps(layout):
    mode, world, overrides = MUON_LAYOUTS[layout]
    cfg, shards = plan("model=llama_tiny", "optim=muon", *overrides, mode=mode, world=world)
    live = owned_muon_bytes(cfg, mode, world)
    assert shards.muon == max(live)
    assert 0 < min(live)  # every rank owns some: spread, not one rank stepping them all
    # the table's optimizer row: the busiest rank's AdamW shards and its Muon state
    est = estimate(cfg, mode, world, cfg.train.micro_batch_size)
    assert est.optim == shards.optim[shards.busiest_rank] + max(live)
