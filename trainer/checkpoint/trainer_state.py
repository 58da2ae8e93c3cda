"""What a checkpoint's trainer_state.json holds of the trainer, and the counters a resume takes back.

The model, optimizer and data loaders save their own state (DCP shards, the loaders' positions);
this is the rest: the step and token counters, the best and last losses, the seconds of every
session (training, the time left out of it, the wall clock), the target's record, how the run ran
(resume_notes.ran_with: world, mode, batch split, threads...; what a continuation is checked
against), the data's and tokenizer's identity, and each rank's loader position and RNG state.
Torch-free: JSON in, JSON out.
"""

from __future__ import annotations

import math
import time

from trainer.checkpoint.layout import FORMAT_VERSION


def _json_float(value: float) -> float | None:
    """JSON has no inf or nan: a loss not measured yet is null."""
    return value if math.isfinite(value) else None


def state_record(state, ran_with: dict, identity: dict, loaders: list, rngs: list) -> dict:
    """trainer_state.json of a save: `state` is the loop's TrainState, `ran_with` how this run runs,
    `identity` its data's and tokenizer's, `loaders` and `rngs` every rank's, in rank order."""
    return {
        "format": FORMAT_VERSION,
        "step": state.step,
        "tokens": state.tokens,
        "best_val_loss": _json_float(state.best_val_loss),
        "last_loss": _json_float(state.last_loss),
        "train_s": state.train_s, "excluded_s": state.excluded_s, "wall_s": state.wall_s,  # over every session
        "target": state.target,  # trainer/fit/target.py
        **ran_with,
        **identity,  # "data" and "tokenizer"
        "time": time.time(),
        "loaders": loaders,
        "rng": rngs,
    }


def restore_counters(state, saved: dict) -> None:
    """The TrainState fields of a checkpoint's trainer state (`saved`), as state_record wrote them."""
    state.step, state.tokens = int(saved["step"]), int(saved["tokens"])
    best, last = saved.get("best_val_loss"), saved.get("last_loss")
    state.best_val_loss = math.inf if best is None else float(best)
    state.last_loss = math.nan if last is None else float(last)
    state.train_s, state.target = float(saved.get("train_s", 0.0)), saved.get("target")
    state.excluded_s = dict(saved.get("excluded_s") or {})
    # a checkpoint saved before wall_s was kept: its seconds were train_s plus excluded_s all the same
    state.wall_s = float(saved.get("wall_s", state.train_s + math.fsum(state.excluded_s.values())))
