"""The RNG states a checkpoint keeps (trainer/checkpoint/rng.py), through the JSON of
trainer_state.json: after a restore, torch (dropout), numpy and Python draw what they drew after the
save. The resume tests run models without dropout, which draw nothing from torch's generator, so
they cannot tell whether it was restored."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _leave_the_generators_as_found():
    before = rng_state(CPU)  # the tests below reseed the process's generators
    yield
    set_rng_state(before, CPU)


def draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


def test_a_restored_state_draws_what_the_saved_one_drew():
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    saved = json.loads(json.dumps(rng_state(CPU)))  # as trainer_state.json holds it
    after_save = draws()
    torch.manual_seed(7), np.random.seed(8), random.seed(9)  # what a fresh process would have
    assert draws() != after_save
    set_rng_state(saved, CPU)
    assert draws() == after_save


def test_dropout_after_a_restore_is_the_same_dropout():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.5)).train()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    saved = json.loads(json.dumps(rng_state(CPU)))
    logits, _ = model(x)
    torch.manual_seed(123)
    set_rng_state(saved, CPU)
    again, _ = model(x)
    assert torch.equal(logits, again)
