"""Time to target (train.target_val_loss, or train.target_val_bpb in bits per byte): the first
validation at or below the target records when the run got there, in the run summary's `target`
record, and ends the run unless train.continue_after_target. The rules speedrun records use:
training seconds leave out evaluation, checkpoints and the session's first step (compilation,
allocator warm-up), each reported beside them; FLOPs are the model's own count per token (6N plus
attention) times tokens.

    {"reached": true, "target_val_loss": 4.5, "val_loss": 4.49, "step": 120, "tokens": 491520,
     "train_s": 31.2, "excluded_s": {"warmup": 2.1, "evaluation": 9.8, "checkpoint": 1.4},
     "flops": 1.2e15}

A bits-per-byte target records "target_val_bpb" and "val_bpb" instead. A run that ends above it
records {"reached": false, "target_val_loss": ..., "best_val_loss": ...}. No torch here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class TargetWatch:
    """The loop's view of train.target_val_loss; the record lives in TrainState.target (a
    checkpoint keeps it, so a continued run neither records nor stops twice)."""

    def __init__(self, train_cfg, flops_per_token: float):
        # one figure: val_loss (train.target_val_loss) or val_bpb (train.target_val_bpb; the checks
        # refuse both at once)
        bpb = getattr(train_cfg, "target_val_bpb", None)
        self.figure = "val_bpb" if bpb is not None else "val_loss"
        self.target = bpb if bpb is not None else train_cfg.target_val_loss
        self.go_on = train_cfg.continue_after_target
        self.flops_per_token = flops_per_token

    def reached(self, figures: Mapping[str, float], state) -> bool:
        """After an evaluation (its seconds already counted as excluded), with its `figures` (the
        validation's {"val_loss": ..., "val_bpb": ..., ...}): record the target when the watched
        figure is at or below it for the first time; True when the run is to end here. The watch,
        not the loop, picks the figure, so the choice is tested in-process (tests/unit/test_target_watch.py)."""
        if self.target is None or state.target is not None:
            return False
        value = figures[self.figure]
        if not value <= self.target:  # nan is never at or below
            return False
        state.target = {
            "reached": True, f"target_{self.figure}": self.target, self.figure: value,
            "step": state.step, "tokens": state.tokens, "train_s": state.train_s,
            "excluded_s": dict(state.excluded_s), "flops": self.flops_per_token * state.tokens,
        }
        return not self.go_on

    def record(self, state) -> dict[str, Any] | None:
        """The summary's `target` record: the one recorded, or that the run ended above the target."""
        if self.target is None:
            return None
        if state.target is not None:
            return state.target
        if self.figure == "val_bpb":
            return {"reached": False, "target_val_bpb": self.target, "step": state.step}
        best = state.best_val_loss if math.isfinite(state.best_val_loss) else None
        return {"reached": False, "target_val_loss": self.target, "best_val_loss": best, "step": state.step}


def describe_target(record: dict[str, Any] | None) -> str | None:
    """The summary table's line for a target record (None without a target)."""
    if record is None:
        return None
    figure = "val_bpb" if "target_val_bpb" in record else "val_loss"
    name = figure.replace("_", " ")
    if not record.get("reached"):
        best = record.get("best_val_loss")
        return (f"{name} {record[f'target_{figure}']} not reached in {record['step']} steps"
                + (f" (best {'-' if best is None else f'{best:.4f}'})" if figure == "val_loss" else ""))
    excluded = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in record["excluded_s"].items())
    return (f"{name} {record[figure]:.4f} <= {record[f'target_{figure}']} at step {record['step']}: "
            f"{record['train_s']:.1f} s training (excluded: {excluded or 'none'} s), "
            f"{record['tokens']:,} tokens, {record['flops']:.3g} FLOPs")
