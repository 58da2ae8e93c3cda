"""train.loss_kernel: chunked gives plain's loss, gradients and per-token losses (val_bpb's) within
1e-5 in fp32, ignored targets (-100) included; auto resolves as documented; fused, which needs CUDA and
liger-kernel, is one line elsewhere (the CLI case: tests/cli/test_one_line_rule.py), and on a GPU gives
plain's within bf16's tolerance (marked cuda: run where a GPU is lent, scripts/gpu_session.sh)."""

from __future__ import annotations

import pytest
import torch

from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.loss import IGNORE_INDEX, fused_installed, resolve_loss_kernel

SHAPE = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=300, pad_vocab_multiple=64)


def _run(model: GPT, kernel: str, chunks: int, x, y):
    model.loss_kernel, model.loss_chunks = kernel, chunks
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    with torch.no_grad():
        _, per_token = model(x, y, per_token=True)
    return logits, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, per_token


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_equals_plain_with_ignored_targets(chunks, tied):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE.__dict__, "tie_embeddings": tied}))
    x, y = torch.randint(0, 300, (4, 48)), torch.randint(0, 300, (4, 48))
    y[0, :10] = IGNORE_INDEX  # e.g. a prompt or padding that is not scored
    y[2, 30:] = IGNORE_INDEX
    _, want, want_grads, want_tokens = _run(model, "plain", 1, x, y)
    logits, got, grads, tokens = _run(model, "chunked", chunks, x, y)
    assert logits is None  # never made whole
    assert abs(got - want) < 1e-5
    for name, grad in want_grads.items():
        assert (grads[name] - grad).abs().max().item() < 1e-5, name
    assert tokens.shape == want_tokens.shape == (4 * 48,)
    assert (tokens - want_tokens).abs().max().item() < 1e-5
    assert (tokens.view(4, 48)[0, :10] == 0).all()  # an ignored position scores nothing
    # the mean is over the scored positions only, as F.cross_entropy's
    assert abs(want - want_tokens.sum().item() / (y != IGNORE_INDEX).sum().item()) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and fused_installed()),
                    reason="needs a CUDA device" if not torch.cuda.is_available()
                    else "needs liger-kernel: pip install 'dtrain[fused]'")
@pytest.mark.parametrize("tied", [True, False])
def test_fused_equals_plain_in_bf16_on_cuda(tied):
    """The loss, every parameter's gradient and the per-token losses of liger-kernel's fused head
    against the whole logits', both under bf16 autocast as a run computes them. Measured on a CPU
    with Triton's interpreter (TRITON_INTERPRET=1, 2026-11-29): in fp32 all within 3e-6 of plain's;
    in bf16 the losses within 1e-6 and the gradients within 1.3% of each tensor's largest (bf16's
    8-bit mantissa in the gradients' matmuls), hence the bounds."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE.__dict__, "vocab_size": 5000, "tie_embeddings": tied})).cuda()
    x, y = torch.randint(0, 5000, (4, 48), device="cuda"), torch.randint(0, 5000, (4, 48), device="cuda")
    y[0, :10] = IGNORE_INDEX
    y[2, 30:] = IGNORE_INDEX
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, want, want_grads, want_tokens = _run(model, "plain", 1, x, y)
        logits, got, grads, tokens = _run(model, "fused", 1, x, y)
    assert logits is None  # never made whole
    assert abs(got - want) < 1e-3 * abs(want), (got, want)
    for name, grad in want_grads.items():
        scale = grad.abs().max().item()
        assert (grads[name] - grad).abs().max().item() <= 3e-2 * scale, name
    assert tokens.shape == want_tokens.shape == (4 * 48,)
    assert (tokens - want_tokens).abs().max().item() < 1e-3 * want_tokens.abs().max().item()
    assert (tokens.view(4, 48)[0, :10] == 0).all()  # an ignored position scores nothing


def test_auto_resolves_by_pieces_device_and_extra():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_loss_kernel("auto", 1, cpu) == "plain"
    assert resolve_loss_kernel("auto", 4, cpu) == "chunked"  # an older config's loss_chunks keeps its meaning
    assert resolve_loss_kernel("auto", 4, cuda) == "chunked"
    assert resolve_loss_kernel("auto", 1, cuda) == ("fused" if fused_installed() else "plain")
    assert resolve_loss_kernel("chunked", 1, cpu) == "chunked"


def test_fused_off_cuda_or_without_the_extra_is_one_line():
    with pytest.raises(ConfigError, match=r"train.loss_kernel=fused .* need a CUDA device, not cpu; use "):
        resolve_loss_kernel("fused", 1, torch.device("cpu"))
    if not fused_installed():  # the test extras leave liger-kernel out: it cannot run on a CPU
        with pytest.raises(ConfigError, match=r"needs liger-kernel, which is not installed; pip install 'dtrain\[fus"):
            resolve_loss_kernel("fused", 1, torch.device("cuda"))


@pytest.mark.parametrize(("overrides", "needle"), [
    (["train.loss_kernel=fast"], "train.loss_kernel='fast' is unknown"),
    (["train.loss_kernel=plain", "train.loss_chunks=4"], "train.loss_chunks=4 computes the loss in pieces"),
    (["train.loss_kernel=fused", "train.loss_chunks=4"], "which train.loss_kernel=fused does not"),
])
def test_bad_values_and_conflicts_are_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(compose(overrides))
    validate(compose(["train.loss_kernel=chunked", "train.loss_chunks=4"]))
