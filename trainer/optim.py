"""AdamW with weight decay on 2-D weights only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed 2-D weights (matmuls, embeddings) and undecayed biases / LayerNorms."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields the tied embedding once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


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


def build_adamw(model: nn.Module, optim_cfg, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, optim_cfg.weight_decay), **adamw_kwargs(optim_cfg, device))


def lr_at(step: int, optim_cfg, max_steps: int) -> float:
    """Linear warmup to optim.lr over warmup_steps, then cosine decay to min_lr at max_steps."""
    lr, min_lr, warmup = optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= max_steps:
        return min_lr
    progress = (step - warmup) / max(1, max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
