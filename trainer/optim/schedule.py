"""The learning-rate schedule: linear warmup, then cosine, warmup-stable-decay or linear decay."""

from __future__ import annotations

import math


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


def warmup_notice(optim_cfg, max_steps: int) -> str | None:
    """A word when the warmup fills the whole run (optim.warmup_steps >= train.max_steps): the rate
    climbs until the last step and never decays, what a short run cut from a longer recipe's
    warmup does unawares. None otherwise."""
    warmup = optim_cfg.warmup_steps
    if warmup < max_steps:
        return None
    last = lr_at(max_steps - 1, optim_cfg, max_steps)
    return (f"optim.warmup_steps={warmup} is not below train.max_steps={max_steps}: the whole run warms up, its "
            f"learning rate reaching {last:.2e} ({last / optim_cfg.lr:.0%} of optim.lr) at the last step and never "
            f"decaying; for a run this short lower optim.warmup_steps (e.g. {max(1, max_steps // 10)})")


def set_lr(optimizer, lr: float) -> None:
    """The scheduled lr on every group (Muon's scaled by its lr_scale)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)

