"""train.loss_chunks: the loss in pieces equals the whole-batch loss (1e-6 relative, CPU fp32), and
so do the gradients; a training run with pieces tracks one without in every parallel mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.runs import assert_matches_one_process

from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.loss import chunked_cross_entropy

SHAPE = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=300, pad_vocab_multiple=64)


def _loss_and_grads(model: GPT, x, y, chunks: int):
    model.loss_chunks = chunks
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunks", [2, 3, 64])
def test_chunked_loss_and_gradients_equal_the_whole(tied, chunks):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE.__dict__, "tie_embeddings": tied}))
    x, y = torch.randint(0, 300, (4, 48)), torch.randint(0, 300, (4, 48))
    _, want, want_grads = _loss_and_grads(model, x, y, 1)
    logits, got, got_grads = _loss_and_grads(model, x, y, chunks)
    assert logits is None  # the whole logits are never made
    assert abs(got.item() / want.item() - 1) < 1e-6
    for name, grad in want_grads.items():
        scale = grad.abs().max().item()
        assert (got_grads[name] - grad).abs().max().item() <= 1e-6 * scale + 1e-12, name


def test_without_grad_the_pieces_give_the_same_loss():
    torch.manual_seed(1)
    x, w = torch.randn(10, 16), torch.randn(70, 16, requires_grad=True)
    t = torch.randint(0, 70, (10,))
    want = F.cross_entropy(x @ w.T, t)
    with torch.no_grad():
        got = chunked_cross_entropy(x, w, t, 3)
    assert abs(got.item() / want.item() - 1) < 1e-6


def test_bf16_autocast_pieces_match_the_whole_head():
    """Under autocast the pieces' matmuls run in bf16 as the whole head's do: same loss to bf16 rounding."""
    torch.manual_seed(2)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(128, 32, requires_grad=True)
    t = torch.randint(0, 128, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = F.cross_entropy(F.linear(x, w).float(), t)
        pieces = chunked_cross_entropy(x, w, t, 4)
    gw_whole, gx_whole = torch.autograd.grad(whole, (w, x))
    gw, gx = torch.autograd.grad(pieces, (w, x))
    assert gw.dtype == w.dtype and gx.dtype == x.dtype
    assert abs(pieces.item() - whole.item()) < 1e-6 * abs(whole.item()) + 1e-3
    assert (gw - gw_whole).abs().max() < 0.02 * gw_whole.abs().max()
    assert (gx - gx_whole).abs().max() < 0.02 * gx_whole.abs().max()


STEPS = 10
TOTAL = ["train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={STEPS}", "optim.lr=1e-3"]
MODES = {
    "none": ["parallel=none", "train.micro_batch_size=4"],
    "dp": ["parallel=dp", "train.micro_batch_size=4"],
    "ddp": ["parallel=ddp", "world=2", "train.micro_batch_size=2"],
    "zero": ["parallel=zero", "world=2", "train.micro_batch_size=2"],
    "zero_torch": ["parallel=zero_torch", "world=2", "train.micro_batch_size=2"],
    "fsdp": ["parallel=fsdp", "world=2", "train.micro_batch_size=2"],
}


def _losses(data_dir, run_dir, *overrides):
    run_dtrain(tiny_args(data_dir, run_dir, *TOTAL, *overrides), check=True)
    return train_losses(run_dir)


@pytest.fixture(scope="module")
def whole_head(data_dir, tmp_path_factory):
    return _losses(data_dir, tmp_path_factory.mktemp("whole") / "run", *MODES["none"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_training_with_loss_chunks_tracks_the_whole_loss(mode, whole_head, data_dir, tmp_path):
    """fsdp (the tied head's weight unsharded in the root unit) is the quick tier's case."""
    got = _losses(data_dir, tmp_path / "run", *MODES[mode], "train.loss_chunks=4")
    assert_matches_one_process(whole_head, got, STEPS, f"{mode} loss_chunks=4")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp"])
def test_compiled_with_loss_chunks_and_a_compile_mode(mode, whole_head, data_dir, tmp_path):
    got = _losses(data_dir, tmp_path / "run", *MODES[mode], "train.loss_chunks=4", "train.compile=true",
                  "train.compile_mode=max-autotune-no-cudagraphs")
    worst = max(abs(got[s] - whole_head[s]) for s in whole_head)
    assert sorted(got) == list(range(1, STEPS + 1)) and worst < 1e-4, worst  # inductor reorders fp32 sums


@pytest.mark.parametrize("args,needle", [
    (["train.compile_mode=fast"], "train.compile_mode='fast' is unknown"),
    (["train.compile_mode=reduce-overhead"], "needs train.compile=true"),
    (["train.loss_chunks=0"], "train.loss_chunks=0 must be at least 1"),
    (["train.seq_len=16", "train.loss_chunks=17"], "exceeds train.seq_len=16"),
])
def test_bad_values_are_one_line(args, needle, data_dir, tmp_path):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", *args))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
