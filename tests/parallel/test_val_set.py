"""Validation comparable across runs (issue 45 item 3): the validation set is train.val_tokens tokens
of the val split, the same whatever the micro batch, world or accumulation, and its loss is per
token, so runs that differ only in those score the same figure on the same weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.checkpoints import ONE_CPU_PROCESS
from helpers.dist_workers import every_rank, val_figures_on_weights
from helpers.dtrain import SMALL_VOCAB, tokenizer_args

from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.data.val_set import ValidationSet
from trainer.fit.run import Run

# 20 sequences of 48 tokens, which no micro batch and world here divide: every case but one process
# at micro batch 4 ends on a padded batch
BASE = ["model=tiny", "data=text", "data.name=corpus", "train.device=cpu", "train.seq_len=48", "train.val_tokens=999",
        "train.grad_accum_steps=1", "optim.lr=3e-3", "optim.warmup_steps=2"]


def config(data_dir, *overrides: str):
    return compose([*BASE, f"data.dir={data_dir}", *tokenizer_args(data_dir), *overrides])


@pytest.fixture(scope="module")
def trained_weights(data_dir, module_tmp) -> str:
    """The tiny model trained 8 steps in this process: weights whose losses differ from token to token."""
    root = module_tmp.mktemp("val_weights")
    run = Run(config(data_dir, "train.micro_batch_size=4"), ONE_CPU_PROCESS, root)
    for step in range(8):
        run.train_step(step)
    path = root / "weights.pt"
    torch.save(run.strategy.unwrap(run.model).state_dict(), path)
    return str(path)


def test_val_loss_is_the_same_at_any_micro_batch_and_world(data_dir, trained_weights, tmp_path):
    """micro batch 4 and 8 in one process and under DDP at world 2 (real gloo workers), on the same
    weights: val loss and bits per byte within 1e-6."""
    figures = {}
    for micro in (4, 8):
        run = Run(config(data_dir, f"train.micro_batch_size={micro}"), ONE_CPU_PROCESS, tmp_path)
        run.strategy.unwrap(run.model).load_state_dict(torch.load(trained_weights))
        figures[f"world 1, micro {micro}"] = run.val_figures()
    ddp = [to_dict(config(data_dir, f"train.micro_batch_size={micro}", "parallel=ddp", "world=2")) for micro in (4, 8)]
    ranks = every_rank(val_figures_on_weights, 2, ddp, str(tmp_path), trained_weights)
    assert ranks[0] == ranks[1]  # every rank reports the all-reduced figures
    figures.update({f"world 2 (ddp), micro {micro}": f for micro, f in zip((4, 8), ranks[0])})
    want = figures["world 1, micro 4"]
    assert 4 < want["val_loss"] < math.log(SMALL_VOCAB)  # learned something, far from a broken figure
    for case, got in figures.items():
        for key in ("val_loss", "val_bpb"):
            assert abs(got[key] - want[key]) < 1e-6, f"{case}: {key} {got[key]} vs {want[key]}"


@pytest.mark.parametrize("micro,world", [(4, 1), (8, 1), (4, 2), (8, 2), (3, 3), (64, 4), (2, 30)])
def test_every_rank_runs_as_many_batches_and_the_set_is_read_once(micro, world):
    """Two shards (a sequence never spans them); 23 sequences asked of 25: each read once over the
    ranks, padding rows not kept, and every rank runs the same number of forwards (at world 30, seven
    ranks hold none and run one batch of padding)."""
    shards = [np.arange(10 * 16 + 5, dtype=np.uint16), np.arange(1000, 1000 + 15 * 16 + 1, dtype=np.uint16)]
    read, batches = [], set()
    for rank in range(world):
        val = ValidationSet(shards, 23 * 16 + 7, micro, 16, rank, world, torch.device("cpu"), 50257, "val", "redo")
        assert (val.sequences, val.tokens) == (23, 23 * 16)
        count = 0
        for x, y, kept in val:
            count += 1
            assert x.shape == y.shape == kept.shape == (micro, 16)
            assert torch.equal(x[:, 1:], y[:, :-1])
            read += [int(row[0]) for row, k in zip(x, kept[:, 0]) if k]
        batches.add(count)
    assert len(batches) == 1  # the same number of forward passes on every rank
    assert sorted(read) == [16 * i for i in range(10)] + [1000 + 16 * i for i in range(13)]


def test_a_set_larger_than_the_split_is_the_whole_split():
    shards = [np.arange(3 * 16 + 1, dtype=np.uint16)]
    val = ValidationSet(shards, 10**9, 4, 16, 0, 1, torch.device("cpu"), 50257, "val", "redo")
    assert val.sequences == 3 and val.batches == 1
