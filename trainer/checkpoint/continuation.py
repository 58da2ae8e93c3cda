"""A continuation checked against what the run was, not only against its keys.

Every checkpoint records the quantities the trajectory depends on beyond the config's keys: the
global batch in tokens (and the micro batch, sequence length, accumulation and world it came from)
and the data's identity (trainer/data/identity.py). The same command run again in the run directory
(resume=auto) must train on those terms: another world size or mode that keeps the global batch
continues (accumulation is derived again); one that changes it, or data prepared again from other
text, is one `error:` line naming the way to continue on the same terms, or `resume=PATH` to
continue on new terms on purpose. Torch-free: it runs before anything is written or imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint.layout import STATE_FILE, latest_checkpoint
from trainer.config import batch_plan
from trainer.data.identity import data_identity, identity_changes
from trainer.data.layout import dataset_dir
from trainer.data.prepare import as_data_cfg
from trainer.errors import ConfigError, DataError


def recorded_state(ckpt: Path) -> dict | None:
    """A checkpoint's trainer state, or None when unreadable (the resume's verification says why)."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def check_continuation(cfg, run_dir: Path, world: int) -> None:
    """The run directory's newest checkpoint against this command's global batch and data."""
    ckpt = latest_checkpoint(run_dir)
    saved = recorded_state(ckpt) if ckpt is not None else None
    if saved is None:
        return  # nothing to continue: the run starts over from step 0
    _check_global_batch(cfg, world, run_dir, ckpt, saved)
    _check_data(cfg, run_dir, ckpt, saved)


def _check_global_batch(cfg, world: int, run_dir: Path, ckpt: Path, saved: dict) -> None:
    recorded = saved.get("total_batch_size")
    if not isinstance(recorded, int):
        return
    plan = batch_plan(cfg, world)
    if plan.total_batch_size == recorded:
        return
    parts = [saved.get(k) for k in ("micro_batch_size", "seq_len", "world", "grad_accum_steps")]
    made_of = ""
    if all(isinstance(p, int) for p in parts):
        made_of = " = {} x {} x world {} x {} accumulation".format(*parts)
    raise ConfigError(
        f"the run in {run_dir} trained with a global batch of {recorded:,} tokens{made_of} "
        f"({ckpt.name}), this command's is {plan.total_batch_size:,} = {plan.micro_batch_size} x {plan.seq_len} "
        f"x world {world} x {plan.grad_accum_steps} accumulation; add train.total_batch_size={recorded} to "
        f"continue it on the same terms (accumulation is derived again), resume={run_dir} to continue with the "
        "new batch on purpose, or choose another hydra.run.dir="
    )


def _check_data(cfg, run_dir: Path, ckpt: Path, saved: dict) -> None:
    was = saved.get("data")
    now = data_identity(cfg.data)
    if not isinstance(was, dict) or now is None:
        return  # a checkpoint from before data identities were recorded
    changes = identity_changes(was, now)
    if changes:
        folder = dataset_dir(as_data_cfg(cfg.data))
        raise DataError(
            f"dataset {cfg.data.name!r} in {folder} is not the data the run in {run_dir} trained on "
            f"({ckpt.name}): {'; '.join(changes)}; prepare the data it trained on again to continue it, "
            f"resume={run_dir} to continue on the new data on purpose, or choose another hydra.run.dir="
        )
