"""Bits per byte (issue 36 item 5): validation's summed loss in bits over the UTF-8 bytes of the
scored target tokens, from the per-token losses of a validation pass (a run's metrics.jsonl, console,
summary and report: tests/cli/test_logs.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import ONE_CPU_PROCESS

from trainer.config.compose import compose
from trainer.data.shard_reader import open_split
from trainer.fit.run import Run
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.tokenizers.gpt2 import EOT, encode, token_byte_lengths


def test_byte_lengths_add_up_to_the_texts_bytes():
    text = "Hello, wörld: naïve café ✓ — 東京\n\tend"
    lengths = token_byte_lengths()
    assert sum(lengths[i] for i in encode(text)) == len(text.encode("utf-8"))
    assert lengths[EOT] == 0 and min(lengths[:EOT]) >= 1


@pytest.mark.parametrize("chunks", [1, 4])
def test_per_token_losses_average_to_the_loss(chunks):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300))
    model.loss_chunks = chunks
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        _, loss = model(x, y)
        _, losses = model(x, y, per_token=True)
    assert losses.shape == (32,)
    assert losses.mean().item() == pytest.approx(loss.item(), rel=1e-6)


def test_val_loss_and_bpb_are_per_token_over_the_first_val_tokens(gpt2_data_dir, tmp_path):
    """The figures of the first floor(val_tokens / seq_len) sequences of the val split (7 here: micro
    batches of 2, the last padded), computed here in one batch straight from the shard."""
    cfg = compose(["model=tiny", "data=text", "data.name=corpus", f"data.dir={gpt2_data_dir}", "train.device=cpu",
                   "train.micro_batch_size=2", "train.seq_len=32", "train.grad_accum_steps=1", "train.val_tokens=229"])
    run = Run(cfg, ONE_CPU_PROCESS, Path(tmp_path))
    loss, bpb = run.val_loss()
    assert run.val_sets["corpus"].batches == 4
    ids = torch.from_numpy(open_split(cfg.data, "val")[0][: 7 * 32 + 1].astype("int64"))
    rows = torch.stack([ids[i * 32 : i * 32 + 33] for i in range(7)])
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    with torch.no_grad():
        logits, _ = run.model(x, y)
    per = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="none")
    lengths = torch.tensor(token_byte_lengths())[y.reshape(-1)]
    assert loss == pytest.approx(per.mean().item(), rel=1e-6)  # every target, the document boundaries too
    assert bpb == pytest.approx(per[lengths > 0].sum().item() / math.log(2) / lengths.sum().item(), rel=1e-6)
