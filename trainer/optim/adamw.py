"""AdamW (torch.optim.AdamW), dtrain's default optimizer, and the elementwise half of optim=muon:
exp_avg and exp_avg_sq per parameter and a step count; its fused kernel on CUDA (optim.fused=auto)."""

from __future__ import annotations

from typing import Any

import torch

from trainer.optim.registry import Elementwise, State


def adamw_kwargs(optim_cfg, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for torch.optim.AdamW (the weight decay is per parameter group)."""
    choice = optim_cfg.fused.lower()  # `optim.fused=true` arrives as 'True' (Hydra reads a bool)
    fused = device.type == "cuda" if choice == "auto" else choice == "true"
    return dict(
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        fused=fused,
    )


# The unfused step's temporaries are sqrt(v) and its scaled copy; CUDA's fused kernel makes none.
OPTIMIZER = Elementwise("AdamW", torch.optim.AdamW, adamw_kwargs,
                        State(tensors=("exp_avg", "exp_avg_sq"), scalars=("step",)),
                        step_copies={"cpu": 2, "cuda": 0})
