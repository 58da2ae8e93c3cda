"""Bits per byte under a corpus-trained tokenizer (tokenizer=hf): val_bpb counts that tokenizer's
bytes per token, not GPT-2's. Bits per byte is what compares runs of different tokenizers, so a run
that took GPT-2's table for another tokenizer's ids must fail here. (GPT-2's own: tests/unit/test_bpb.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checkpoints import ONE_CPU_PROCESS
from helpers.dtrain import corpus_text, run_dtrain
from helpers.tokenizers import byte_level_folder

from trainer.config.compose import compose
from trainer.data.shard_reader import open_split
from trainer.fit.run import Run
from trainer.tokenizers.gpt2 import token_byte_lengths

SEQ, ROWS = 32, 6


def test_val_bpb_counts_the_run_tokenizers_bytes(tmp_path):
    text = corpus_text()[:200_000]
    (tmp_path / "corpus.txt").write_text(text)
    folder = byte_level_folder(tmp_path / "tok", [text[:100_000]], 600)
    data = [f"data.dir={tmp_path / 'data'}", "data=text", "data.name=own", "tokenizer=hf", f"tokenizer.path={folder}"]
    run_dtrain(["prepare", *data, f"data.source={tmp_path / 'corpus.txt'}"], check=True)
    cfg = compose(["model=tiny", *data, "train.device=cpu", "train.micro_batch_size=2", f"train.seq_len={SEQ}",
                   "train.grad_accum_steps=1", f"train.val_tokens={ROWS * SEQ}"])
    run = Run(cfg, ONE_CPU_PROCESS, tmp_path / "run")
    loss, bpb = run.val_loss()

    # the same targets straight from the val shard, their bytes from the tokenizer.json itself:
    # a byte-level token's string holds one character per byte; the end-of-text token stands for none
    tokenizer = pytest.importorskip("tokenizers").Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = torch.from_numpy(open_split(cfg.data, "val")[0][: ROWS * SEQ + 1].astype("int64"))
    rows = torch.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(ROWS)])
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].reshape(-1)
    with torch.no_grad():
        logits, _ = run.model(x, rows[:, 1:].contiguous())
    per = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y, reduction="none")
    own = torch.tensor([0 if t == eot else len(tokenizer.id_to_token(t)) for t in y.tolist()])
    assert loss == pytest.approx(per.mean().item(), rel=1e-6)
    assert bpb == pytest.approx(per[own > 0].sum().item() / math.log(2) / own.sum().item(), rel=1e-6)
    # GPT-2's table for the same ids counts other bytes, so the check above tells the two apart
    gpt2 = torch.tensor(token_byte_lengths())[y]
    assert bpb != pytest.approx(per[gpt2 > 0].sum().item() / math.log(2) / gpt2.sum().item(), rel=1e-3)
