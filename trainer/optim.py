"""The optimizers (AdamW alone, or Muon on the hidden matrices and AdamW on the rest) and the
warmup + cosine learning-rate schedule.

Which parameter goes to which optimizer is decided here once, by its role (GPT.param_role): Muon
orthogonalizes updates of the blocks' 2-D matrices, where that helps; embeddings, the output head,
norms and biases are not matrices of that kind and stay on AdamW. Every mode builds its optimizers
from `split_params`, and the run's first line shows the split (`describe_split`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from trainer.model.gpt import GPT
from trainer.muon import BatchedMuon

MUON_ROLES = ("hidden",)
# What each optimizer keeps per parameter (checkpoint templates, the memory plan's state count).
STATE_KEYS = {"AdamW": ("step", "exp_avg", "exp_avg_sq"), "BatchedMuon": ("momentum_buffer",)}


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
    choice = optim_cfg.fused.lower()  # `optim.fused=true` arrives as 'True' (Hydra reads a bool)
    fused = device.type == "cuda" if choice == "auto" else choice == "true"
    return dict(
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        fused=fused,
    )


def muon_kwargs(optim_cfg, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for BatchedMuon (Newton-Schulz in bfloat16 on CUDA and float32 elsewhere
    with optim.muon.ns_dtype=auto; its two stacked steps compiled on CUDA)."""
    m = optim_cfg.muon
    dtype = m.ns_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return dict(lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr, ns_dtype=getattr(torch, dtype),
                compiled=device.type == "cuda")


def muon_parts(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> dict[nn.Parameter, tuple[int, ...]]:
    """{hidden matrix: the row widths of the matrices it holds} (q, k, v; gate, up), as the model says."""
    return {param: model.matrix_parts(name, param.shape[0]) for name, param in named}


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


def _arithmetic(part):
    """The optimizer object that does a part's arithmetic (ZeRO's wrappers keep it as `optim`)."""
    return getattr(part, "optim", part)


def masks_on_device(optimizer) -> bool:
    """Whether every part can skip its update on a device-side verdict without a host sync: fused
    AdamW reads `found_inf` (how GradScaler skips a step), and so do Muon's (`masks_on_device`)."""
    return all(getattr(_arithmetic(part), "masks_on_device", False)
               or bool(getattr(_arithmetic(part), "defaults", {}).get("fused")) for part in parts(optimizer))


@contextlib.contextmanager
def verdict(optimizer, found_inf: torch.Tensor | None):
    """The step under `found_inf` (1.0: no update), set where each part's arithmetic reads it."""
    targets = [] if found_inf is None else [_arithmetic(part) for part in parts(optimizer)]
    for target in targets:
        target.found_inf = found_inf
    try:
        yield
    finally:
        for target in targets:
            del target.found_inf


def build_optimizer(model: nn.Module, optim_cfg, device: torch.device):
    """AdamW over every parameter, or Optimizers([BatchedMuon, AdamW]) for optim=muon (in none, dp
    and ddp every rank holds whole matrices and equal gradients)."""
    muon, adamw = split_params(model, optim_cfg)
    inner = torch.optim.AdamW(param_groups((p for _, p in adamw), optim_cfg.weight_decay),
                              **adamw_kwargs(optim_cfg, device))
    if not muon:
        return inner
    muon_optimizer = BatchedMuon([muon_group([p for _, p in muon], optim_cfg)], row_parts=muon_parts(model, muon),
                                 **muon_kwargs(optim_cfg, device))
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
    """Linear warmup to optim.lr over warmup_steps, then optim.schedule down to min_lr at max_steps:

    cosine  half a cosine from lr to min_lr over the steps after warmup (the default);
    wsd     warmup-stable-decay: lr held until the last `decay_fraction` of max_steps, then a
            straight line to min_lr (the "warmdown" of nanochat, modded-nanogpt and torchtitan's
            default decay shape). The stable phase does not depend on max_steps, so its
            checkpoints continue into a longer run (resume= with a larger train.max_steps);
    linear  a straight line from lr to min_lr over the steps after warmup.
    """
    lr, min_lr, warmup = optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= max_steps:
        return min_lr
    schedule = optim_cfg.get("schedule", "cosine")
    if schedule == "wsd":
        decay_steps = max(1, round(optim_cfg.decay_fraction * max_steps))
        decay_start = max(warmup, max_steps - decay_steps)
        if step < decay_start:
            return lr
        return lr - (lr - min_lr) * (step - decay_start) / max(1, max_steps - decay_start)
    progress = (step - warmup) / max(1, max_steps - warmup)
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer, lr: float) -> None:
    """The scheduled lr on every group (Muon's scaled by its lr_scale)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)

