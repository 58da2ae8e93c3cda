"""train.loss_chunks: the loss in pieces equals the whole-batch loss (1e-6 relative, CPU fp32), and
so do the gradients (a training run with pieces in every parallel mode: tests/parallel/test_loss_chunks_modes.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
