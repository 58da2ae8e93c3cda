"""The optimizers (AdamW alone, or Muon on the hidden matrices and AdamW on the rest) and the
warmup + cosine learning-rate schedule.

Which parameter goes to which optimizer is decided here once, by its role (GPT.param_role): Muon
orthogonalizes updates of the blocks' 2-D matrices, where that helps; embeddings, the output head,
norms and biases are not matrices of that kind and stay on AdamW. Every mode builds its optimizers
from `split_params`, and the run's first line shows the split (`describe_split`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr  # torch's own per-shape lr rule, shared with the stock Muon

from trainer.model import GPT

MUON_ROLES = ("hidden",)
# What each optimizer keeps per parameter (checkpoint templates, the memory plan's state count).
STATE_KEYS = {"AdamW": ("step", "exp_avg", "exp_avg_sq"), "Muon": ("momentum_buffer",),
              "Float32Muon": ("momentum_buffer",)}


def split_params(model: nn.Module, optim_cfg) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) (name, parameter) pairs; with optim.name=adamw Muon's list is empty."""
    muon, adamw = [], []
    for name, param in model.named_parameters():  # the tied embedding once, under transformer.wte
        if not param.requires_grad:
            continue
        to_muon = optim_cfg.name == "muon" and GPT.param_role(name, param) in MUON_ROLES
        (muon if to_muon else adamw).append((name, param))
    return muon, adamw


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups: decayed 2-D weights (matmuls, embeddings) and undecayed biases / norms."""
    decay, no_decay = [], []
    for param in params:
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def muon_group(params: list[nn.Parameter], optim_cfg) -> dict[str, Any]:
    """Muon's one group; `lr_scale` puts its lr on the schedule as the ratio of the two peaks."""
    return {"params": params, "lr_scale": optim_cfg.muon.lr / optim_cfg.lr}


def adamw_kwargs(optim_cfg, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for torch.optim.AdamW (shared by the plain and ZeRO optimizers)."""
    if optim_cfg.fused == "auto":
        fused = device.type == "cuda"
    else:
        fused = optim_cfg.fused == "true"
    return dict(
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        fused=fused,
    )


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32 (the stock one casts to
    bfloat16). Why: on CPU, bfloat16 matmuls are slower than float32 ones, and bfloat16's
    rounding turns the last-bit differences of a gradient summed in another order (accumulation,
    all-reduce, reduce-scatter) into loss differences of ~1e-4 within 20 steps, so no mode could
    match one process within 1e-5. The state (momentum_buffer), the momentum, the coefficients, the
    shape-adjusted lr (torch's own _adjust_lr) and the decoupled decay are the stock optimizer's."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers):
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def orthogonalize(matrix: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration (torch.optim.Muon's), in float32."""
    a, b, c = coefficients
    wide = matrix.size(0) <= matrix.size(1)
    x = matrix.float() if wide else matrix.float().T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def muon_class(optim_cfg, device: torch.device) -> type[torch.optim.Muon]:
    """torch.optim.Muon (bfloat16 Newton-Schulz) or Float32Muon, as optim.muon.ns_dtype says
    (auto: bfloat16 on CUDA, float32 elsewhere)."""
    dtype = optim_cfg.muon.ns_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return torch.optim.Muon if dtype == "bfloat16" else Float32Muon


def muon_kwargs(optim_cfg) -> dict[str, Any]:
    """Keyword arguments for torch.optim.Muon."""
    m = optim_cfg.muon
    return dict(lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr)


class Optimizers:
    """Several optimizers stepped as one (Muon's and AdamW's): the loop sets the lr through
    `param_groups` and steps; checkpoints hand `parts` to DCP, which takes a list of optimizers."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def parts(optimizer) -> list[Any]:
    """The optimizers inside (one for AdamW alone)."""
    return optimizer.parts if isinstance(optimizer, Optimizers) else [optimizer]


def build_optimizer(model: nn.Module, optim_cfg, device: torch.device):
    """AdamW over every parameter, or Optimizers([Muon, AdamW]) for optim=muon (the stock torch
    optimizers: in none, dp and ddp every rank holds whole matrices and equal gradients)."""
    muon, adamw = split_params(model, optim_cfg)
    inner = torch.optim.AdamW(param_groups((p for _, p in adamw), optim_cfg.weight_decay),
                              **adamw_kwargs(optim_cfg, device))
    if not muon:
        return inner
    muon_optimizer = muon_class(optim_cfg, device)([muon_group([p for _, p in muon], optim_cfg)],
                                                   **muon_kwargs(optim_cfg))
    return Optimizers([muon_optimizer, inner])


def describe_split(model: nn.Module, optim_cfg) -> str:
    """'optim=muon (Muon 0.79M params in 16 matrices, AdamW 6.44M)' for the run's first line."""
    muon, adamw = split_params(model, optim_cfg)
    if not muon:
        return f"optim={optim_cfg.name}"
    count = lambda pairs: sum(p.numel() for _, p in pairs) / 1e6  # noqa: E731
    return (f"optim=muon (Muon {count(muon):.2f}M params in {len(muon)} matrices, "
            f"AdamW {count(adamw):.2f}M in {len(adamw)} tensors)")


def lr_at(step: int, optim_cfg, max_steps: int) -> float:
    """Linear warmup to optim.lr over warmup_steps, then cosine decay to min_lr at max_steps."""
    lr, min_lr, warmup = optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= max_steps:
        return min_lr
    progress = (step - warmup) / max(1, max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer, lr: float) -> None:
    """The scheduled lr on every group (Muon's scaled by its lr_scale)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)

