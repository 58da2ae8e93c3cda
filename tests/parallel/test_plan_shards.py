"""`dtrain plan`'s per-rank model state against the live shards of a real world-4 run: the
parameters, gradients and optimizer state each rank of the plan's meta model under a fake process
group holds (trainer/plan/shards.py) are, byte for byte and rank by rank, what the trained ranks hold,
and Muon's state is what its busiest owner rank keeps."""

from __future__ import annotations

import pytest
from helpers.dist_workers import every_rank, train_and_inspect

from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.plan.memory import estimate
from trainer.plan.shards import shard_plan

WORLD = 4
# One line per layout. tiny ties its embedding and splits GPT-2's 50257 rows unevenly over 4 ranks;
# llama_tiny has grouped KV heads, three MLP matrices and an untied head.
LAYOUTS = [
    ("fsdp", "tiny", ["parallel=fsdp"]),
    # Muon by owner inside each replica's shard group of 2 (AdamW on the rest)
    ("hsdp_muon", "llama_tiny", ["parallel=hsdp", "parallel.dp_replicate=2", "optim=muon"]),
    # Muon's tp shards gathered whole to owners over all 4 ranks
    ("fsdp_tp_muon", "llama_tiny", ["parallel=fsdp", "parallel.tp=2", "optim=muon"]),
    # FSDP shards over dp_shard x cp flattened into one dimension, beside TP (AdamW on the tp shards)
    ("fsdp_cp_tp", "llama_tiny", ["parallel=fsdp", "parallel.cp=2", "parallel.tp=2"]),
    # the experts split by expert over ep 2 and sharded by rows over the other 2 dp_shard ranks
    ("fsdp_ep", "qwen3_moe_tiny", ["parallel=fsdp", "parallel.ep=2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "model", "overrides"), LAYOUTS, ids=[layout for layout, _, _ in LAYOUTS])
def test_the_plan_counts_the_live_shards(layout, model, overrides, gpt2_data_dir, tmp_path):
    cfg = compose([f"model={model}", "data=text", "data.name=corpus", f"data.dir={gpt2_data_dir}", "train.seq_len=32",
                   "train.micro_batch_size=2", f"world={WORLD}", *overrides])
    results = every_rank(train_and_inspect, WORLD, to_dict(cfg), str(tmp_path), 1)
    ranks = [results[r] for r in range(WORLD)]

    plan = shard_plan(cfg, cfg.parallel.mode, WORLD)
    assert list(plan.params) == [r["param_bytes"] for r in ranks]
    assert list(plan.grads) == [r["grad_bytes"] for r in ranks]
    assert list(plan.optim_tensors) == [r["optimizer_bytes"] for r in ranks]  # AdamW's two moments per shard
    # Muon's owned momenta and their zeroed whole work copies, on the busiest owner (0: no Muon)
    assert plan.muon == max(r["muon_bytes"] for r in ranks)
    # the table's figures are the busiest rank's
    est = estimate(cfg, cfg.parallel.mode, WORLD, cfg.train.micro_batch_size)
    assert est.params == max(r["param_bytes"] for r in ranks)
    assert est.grads == max(r["grad_bytes"] for r in ranks)
