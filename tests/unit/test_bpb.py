"""Bits per byte (issue 36 item 5): validation's summed loss in bits over the UTF-8 bytes of the
scored target tokens, beside the loss in metrics.jsonl, the console and the summary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import ONE_CPU_PROCESS
from helpers.dtrain import read_metrics, run_dtrain, tiny_args

from trainer.config.compose import compose
from trainer.data.tokenizer import EOT, encode, token_byte_lengths
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.train.loop import Run


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


def test_val_bpb_is_the_nats_over_the_targets_bytes(data_dir, tmp_path):
    cfg = compose(["model=tiny", "data=text", "data.name=corpus", f"data.dir={data_dir}", "train.device=cpu",
                   "train.micro_batch_size=2", "train.seq_len=32", "train.grad_accum_steps=1", "train.val_batches=3"])
    run = Run(cfg, ONE_CPU_PROCESS, Path(tmp_path))
    loss, bpb = run.val_loss()
    lengths = torch.tensor(token_byte_lengths())
    run.val_loader.reset()
    nats, nbytes, means = 0.0, 0, []
    with torch.no_grad():
        for _ in range(run.val_loader.accum):
            x, y = run.val_loader.next_batch()
            logits, batch_loss = run.model(x, y)
            per = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="none")
            b = lengths[y.view(-1)]
            nats += per[b > 0].sum().item()
            nbytes += b.sum().item()
            means.append(batch_loss.item())
    assert bpb == pytest.approx(nats / math.log(2) / nbytes, rel=1e-6)
    assert loss == pytest.approx(sum(means) / len(means), rel=1e-6)


@pytest.mark.slow
def test_a_run_logs_val_bpb_beside_val_loss(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=4")
    args[args.index("train.val_interval=0")] = "train.val_interval=2"
    proc = run_dtrain(args, check=True)
    vals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4] and all(0 < r["val_bpb"] < 20 for r in vals)
    assert f"step 4: val loss {vals[-1]['val_loss']:.4f} | val bpb {vals[-1]['val_bpb']:.4f}" in proc.stdout
    summary = read_metrics(run_dir)[-1]["summary"]
    assert summary["final_val_bpb"] == pytest.approx(vals[-1]["val_bpb"])
    assert "final val bpb" in proc.stdout
    report = run_dtrain(["report", str(run_dir), f"--out={tmp_path / 'figures'}"], check=True)
    assert "val bpb" in report.stdout and f"{vals[-1]['val_bpb']:.4f}" in report.stdout  # the results table's column
