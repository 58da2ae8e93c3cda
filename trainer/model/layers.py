"""The pieces of a block, each option one class or function: norms, rotary positions, attention
(grouped KV heads, QK-norm), MLPs (GELU, SwiGLU, ReLU squared).

Module names stay GPT-2's in every family (attn.c_attn holds q, k and v side by side; mlp.c_fc
holds SwiGLU's gate and up halves), so strategies, checkpoints and the optimizer's roles see one
model; trainer/huggingface/llama.py maps them to Llama's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.model.config import GPTConfig

# torch < 2.5 has no enable_gqa: there the shared key/value heads are repeated instead.
SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


# model.attention's kernels (trainer/config/schema.py ATTENTION_BACKENDS; auto: none named, SDPA chooses).
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

# A layer's scaled dot-product attention: (q, k, v, mask, causal) -> output, GQA and dropout applied.
AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool], torch.Tensor]


class KeyValues(Protocol):
    """Where attention finds keys and values beyond the layer's own: a decoding cache's slots
    (trainer/model/kv_cache.py LayerStep) or a context-parallel group's whole sequence
    (trainer/parallel/context_parallel.py). It computes the attention of q over them with `sdpa`."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: AttentionCall) -> torch.Tensor: ...


def make_norm(config: GPTConfig, width: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps, bias=config.bias)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (*positions.shape, head_dim), in fp32.

    The "rotate half" layout of GPT-NeoX and Hugging Face Llama: dimension i pairs with i + d/2,
    both at frequency theta^(-2i/d), so Llama's weights need no permutation either way."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) queries or keys; cos/sin broadcast over the heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.dropout = config.dropout
        kv_width = self.n_kv_head * self.head_dim
        self.split_sizes = (config.q_width, kv_width, kv_width)
        self.c_attn = nn.Linear(config.n_embd, config.q_width + 2 * kv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.q_width, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled_init = True
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.qk_norm = config.qk_norm
        # model.attention's kernel (use_attention); None: SDPA picks per call (auto)
        self.backend: SDPBackend | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv: KeyValues | None = None) -> torch.Tensor:
        """Causal attention over x; with `kv`, over the keys and values it holds (a decoding cache's
        earlier slots and x's, or a context-parallel group's sequence)."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_sizes, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # (B, T, heads, head_dim) -> (B, heads, T, head_dim)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = self.sdpa(q, k, v, None, True) if kv is None else kv.attend(q, k, v, self.sdpa)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # -1: a tensor-parallel rank's heads only
        return self.resid_dropout(self.c_proj(y))

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             causal: bool) -> torch.Tensor:
        """Scaled dot-product attention of q over k and v (fewer KV heads: grouped), with dropout."""
        grouped = self.n_kv_head != self.n_head
        if grouped and not SDPA_HAS_GQA:
            repeat = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            grouped = False
        extra = {"enable_gqa": True} if grouped else {}
        dropout = self.dropout if self.training else 0.0
        # A padding mask (batched decoding) or a context-parallel causal bias: SDPA's choice, since
        # flash and cuDNN take no arbitrary mask; model.attention names the kernel of the plain causal calls.
        if self.backend is None or mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, **extra)
        with sdpa_kernel(self.backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, **extra)


def use_attention(model: nn.Module, backend: str) -> None:
    """Every attention layer of `model` computes with model.attention's kernel (`auto`: SDPA's own
    choice per call, kept until make bench-gpu has measured a better one per device and shape)."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.backend = SDPA_BACKENDS.get(backend)


class MLP(nn.Module):
    """gelu: GPT-2's (tanh approximation); relu2: ReLU squared (Primer, the nanoGPT speedrun);
    swiglu: SiLU(gate) x up, with c_fc computing [gate | up] in one matmul (Llama)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind, hidden = config.mlp, config.hidden
        fc_out = 2 * hidden if self.kind == "swiglu" else hidden
        self.c_fc = nn.Linear(config.n_embd, fc_out, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.c_proj.residual_scaled_init = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, mlp: nn.Module | None = None):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = mlp if mlp is not None else MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv: KeyValues | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, kv)
        return x + self.mlp(self.ln_2(x))
