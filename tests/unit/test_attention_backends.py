"""model.attention: each SDPA kernel that runs on the CPU gives the loss and gradients of SDPA's own
choice within 1e-5 (fp32); one the device has no kernel for is one line, found before a run starts
(the CLI case: tests/cli/test_one_line_rule.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.config.compose import compose
from trainer.config.keys import key_kind
from trainer.errors import ConfigError
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.model.layers import CausalSelfAttention, use_attention
from trainer.preflight.torch_checks import check_attention

GPT2_BLOCK = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=128)
# Llama's block: rotary positions, grouped key/value heads (enable_gqa), QK-norm
LLAMA_BLOCK = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=128, norm="rmsnorm",
                        pos="rope", mlp="swiglu", qk_norm=True, bias=False, tie_embeddings=False)


def _loss_and_grads(model: GPT, backend: str, x, y):
    use_attention(model, backend)
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", [GPT2_BLOCK, LLAMA_BLOCK], ids=["gpt2", "llama"])
def test_every_cpu_kernel_gives_the_same_loss_and_gradients(config):
    torch.manual_seed(0)
    model = GPT(config)
    x, y = torch.randint(0, 128, (2, 48)), torch.randint(0, 128, (2, 48))
    want, want_grads = _loss_and_grads(model, "auto", x, y)
    for backend in ("flash", "math"):
        got, grads = _loss_and_grads(model, backend, x, y)
        assert all(m.backend is not None for m in model.modules() if isinstance(m, CausalSelfAttention))
        assert abs(got - want) < 1e-5, backend
        for name, grad in want_grads.items():
            assert (grads[name] - grad).abs().max().item() < 1e-5, (backend, name)


def test_a_named_kernel_is_the_one_that_runs():
    """The kernel is really forced: with only CUDA's efficient kernel allowed, the CPU has none."""
    model = GPT(GPT2_BLOCK)
    use_attention(model, "efficient")
    with pytest.raises(RuntimeError, match="No viable backend"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_the_device_lacks_is_one_line(backend):
    cfg = compose([f"model.attention={backend}", "train.device=cpu"])
    with pytest.raises(ConfigError, match=rf"model.attention={backend} has no kernel .* on cpu .* one of flash, math$"):
        check_attention(cfg, torch.device("cpu"))
    for runs in ("auto", "flash", "math"):
        check_attention(compose([f"model.attention={runs}"]), torch.device("cpu"))


def test_the_kernel_is_no_trajectory_key():
    """Another kernel computes the same model: a run continues under it (an operational key)."""
    assert key_kind("model.attention") == "operational" and key_kind("model.n_embd") == "trajectory"
    assert "attention" not in GPTConfig.__dataclass_fields__  # no shape: checkpoints and exports ignore it
