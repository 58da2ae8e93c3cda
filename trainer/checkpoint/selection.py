"""Which checkpoint a resume loads: each candidate verified before it is trusted, newest first.

resume=auto (and a restarted attempt) walks its own `checkpoints/` folder newest first, verifying
each (integrity: every file against its marker's checksums; verify: the structure). The first
intact one is loaded; every newer corrupt one is renamed `corrupt_step_N` (kept, never deleted,
never resumed or counted by retention) with one line saying why. If none is intact nothing is
moved and the run stops with one line. An explicit resume=PATH is never moved: a corrupt one is
an error naming the newest intact alternative.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.checkpoint.deferred import verify
from trainer.checkpoint.integrity import CorruptCheckpoint, alternative_hint, checkpoints_root
from trainer.checkpoint.layout import corrupt_dir, marked_checkpoints
from trainer.checkpoint.records import none_intact
from trainer.errors import CheckpointError
from trainer.io import fsync_dir

Checked = tuple[Path, tuple]  # (checkpoint, what validate_checkpoint returned)


def set_aside(err: CorruptCheckpoint) -> Path:
    """Rename a corrupt checkpoint out of the `step_*` namespace; returns where it went."""
    dest = corrupt_dir(err.ckpt)
    err.ckpt.rename(dest)
    fsync_dir(dest.parent)
    return dest


def newest_intact(root: Path, model_cfg=None, exclude: Path | None = None) -> Path | None:
    """The newest checkpoint under `root` that verifies (and fits the model), without moving anything."""
    for ckpt in marked_checkpoints(root):
        if exclude is not None and ckpt.resolve() == Path(exclude).resolve():
            continue
        try:
            verify().validate_checkpoint(ckpt, model_cfg)
        except CheckpointError:
            continue
        return ckpt
    return None


def choose_own(root: Path, model_cfg, say: Callable[[str], None]) -> Checked | None:
    """resume=auto: the newest intact checkpoint of this run, corrupt newer ones set aside; None when
    the run has none. A checkpoint that is intact but does not fit (another model) stops the run."""
    corrupt: list[CorruptCheckpoint] = []
    for ckpt in marked_checkpoints(root):
        try:
            checked = verify().validate_checkpoint(ckpt, model_cfg)
        except CorruptCheckpoint as err:
            corrupt.append(err)
            continue
        for err in corrupt:
            dest = set_aside(err)
            say(f"{err}; moved it to {dest.name} and falling back to {ckpt.name}")
        return ckpt, checked
    if corrupt:
        raise CheckpointError(none_intact(corrupt[0], root))
    return None


def check_explicit(ckpt: Path, model_cfg) -> Checked:
    """resume=PATH: the checkpoint verified; a corrupt one is one error naming the newest intact
    checkpoint beside it (nothing is moved: the user chose this path)."""
    try:
        return ckpt, verify().validate_checkpoint(ckpt, model_cfg)
    except CorruptCheckpoint as err:
        alternative = newest_intact(checkpoints_root(ckpt), model_cfg, exclude=ckpt)
        raise CheckpointError(f"{err}; {alternative_hint(ckpt, alternative)}") from None
