"""After training: DDP replicas are identical; ZeRO and FSDP hold ~1/world of the state per rank
(torch's ZeroRedundancyOptimizer: whole parameters, as `dtrain plan` estimates)."""

from __future__ import annotations

import pytest
import torch
from helpers.dist_workers import every_rank, train_and_inspect
from helpers.dtrain import tokenizer_args

from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.optim.build import param_groups
from trainer.parallel import strategy_class


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its balance checks need an embedding
    that dominates the model, as GPT-2's 50,257 rows do."""
    return gpt2_data_dir


def launch(data_dir, tmp_path, world, *overrides, steps=3):
    cfg = compose(["model=tiny", "data=text", "data.name=corpus", f"data.dir={data_dir}", *tokenizer_args(data_dir),
        "train.seq_len=32",
                   "train.micro_batch_size=2", f"world={world}", *overrides])
    results = every_rank(train_and_inspect, world, to_dict(cfg), str(tmp_path), steps)
    return [results[r] for r in range(world)]


@pytest.mark.slow
def test_ddp_replicas_hold_identical_weights(data_dir, tmp_path):
    ranks = launch(data_dir, tmp_path, 2, "parallel=ddp", "train.grad_accum_steps=2")
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["param_bytes"] == ranks[0]["full_param_bytes"]  # DDP replicates everything


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fsdp_shards_params_grads_and_optimizer_state(data_dir, tmp_path, world):
    ranks = launch(data_dir, tmp_path, world, "parallel=fsdp")
    full = ranks[0]["full_param_bytes"]
    assert len({r["digest"] for r in ranks}) == 1  # the gathered model is one model
    for r in ranks:
        # dim-0 sharding pads the last shard by at most a row per parameter
        assert r["param_bytes"] <= full / world * 1.01
        assert r["grad_bytes"] <= full / world * 1.01
        assert r["optimizer_bytes"] <= 2 * full / world * 1.01  # AdamW: exp_avg + exp_avg_sq
    assert sum(r["param_bytes"] for r in ranks) >= full


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_shards_optimizer_state(data_dir, tmp_path, world):
    # The tied embedding is the tiny model's largest tensor by far: sharding whole parameters could not
    # balance it, sharding every parameter's rows does.
    ranks = launch(data_dir, tmp_path, world, "parallel=zero", "train.grad_accum_steps=2")
    full_state = 2 * ranks[0]["full_param_bytes"]  # AdamW: exp_avg + exp_avg_sq
    per_rank = [r["optimizer_bytes"] for r in ranks]
    assert sum(per_rank) == full_state  # every row's state lives on exactly one rank
    assert max(per_rank) <= full_state / world * 1.02
    assert len({r["digest"] for r in ranks}) == 1  # the gathered rows leave identical replicas
    assert ranks[0]["param_bytes"] == ranks[0]["full_param_bytes"]  # parameters stay replicated


@pytest.mark.slow
def test_zero_torch_gives_each_parameter_state_to_one_rank(data_dir, tmp_path):
    # Whole parameters: the rank that gets the tied embedding holds most of the tiny model's state,
    # exactly what the plan's estimate of the largest rank says.
    ranks = launch(data_dir, tmp_path, 2, "parallel=zero_torch")
    full_state = 2 * ranks[0]["full_param_bytes"]
    per_rank = [r["optimizer_bytes"] for r in ranks]
    assert sum(per_rank) == full_state  # every parameter's state lives on exactly one rank
    cfg = compose(["model=tiny"])
    with torch.device("meta"):
        model = GPT(GPTConfig.from_cfg(cfg.model))
    groups = [[p.shape for p in g["params"]] for g in param_groups(model.parameters(), cfg.optim.weight_decay)]
    largest = strategy_class("zero_torch").optimizer_state_numels(groups, 2)
    assert max(per_rank) == 2 * 4 * sum(largest)  # exp_avg + exp_avg_sq, fp32
    assert max(per_rank) > 0.9 * full_state
    assert len({r["digest"] for r in ranks}) == 1
    assert ranks[0]["param_bytes"] == ranks[0]["full_param_bytes"]
