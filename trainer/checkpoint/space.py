"""Room for the next checkpoint, checked before the work is lost.

A save writes the new checkpoint before retention removes old ones, so the disk must hold one more
checkpoint beside those it keeps. When free space alone cannot, the checkpoints that retention would
remove after that save anyway (all but the newest keep-1, and never the newest) are removed first:
checkpoint.keep=1 then needs room for two checkpoints, whatever was kept before. When even that is
not enough, the run says so in one line with the bytes needed and free: at the start (nothing is
written; a fresh run's first checkpoint sized from its config, a continuation's next as large as
its newest), right after a save (for the next one, so no step is trained that could not be saved)
and before a save. Standard library only: the run-directory checks use it before torch is imported.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from trainer.checkpoint.layout import (
    CHECKPOINT_DIR,
    DEL_PREFIX,
    TMP_PREFIX,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
)
from trainer.errors import CheckpointError
from trainer.io import nearest_existing

# Beyond the tensors: the JSON files, the marker and DCP's index (a few KiB for a small model).
MARGIN_BYTES = 1 << 20


def folder_bytes(path: Path) -> int:
    """The bytes of the files in a checkpoint folder."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the step_* namespace first, so a kill midway
    never leaves a half-deleted folder that looks like a checkpoint."""
    if not path.exists():
        return
    doomed = path
    if not path.name.startswith((TMP_PREFIX, DEL_PREFIX)):
        doomed = path.with_name(DEL_PREFIX + path.name)
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def free_bytes(root: Path) -> int:
    return shutil.disk_usage(nearest_existing(root)).free


def retired_early(root: Path, keep: int, pending: Path | None = None, step: int | None = None) -> list[Path]:
    """The checkpoints under `root` that retention removes after the next save anyway, never the
    newest: those may go before it is written. `pending`: a save not yet published (the newest);
    `step`: the run's step, past which checkpoints belong to an abandoned continuation."""
    done = list_checkpoints(root)
    abandoned = [p for p in done if step is not None and (checkpoint_step(p) or 0) > step]
    existing = [p for p in done if p not in abandoned] + ([pending] if pending is not None else [])
    return abandoned + existing[: max(0, len(existing) - max(1, keep - 1))]


def room_problem(root: Path, need: int, keep: int, pending: Path | None = None,
                 step: int | None = None) -> tuple[str | None, list[Path], str]:
    """(None, checkpoints to remove first (maybe none), "") when the next checkpoint of `need` bytes
    fits, else (the problem, [], the advice that works)."""
    need += MARGIN_BYTES
    free = free_bytes(root)
    if free >= need:
        return None, [], ""
    early = retired_early(root, keep, pending, step)
    reclaim = sum(folder_bytes(p) for p in early)
    if free + reclaim >= need:
        return None, early, ""
    freed = f" (+{reclaim:,} in older checkpoints that checkpoint.keep={keep} lets go first)" if early else ""
    at_keep_1 = free + sum(folder_bytes(p) for p in retired_early(root, 1, pending, step))
    if keep > 1 and at_keep_1 >= need:
        advice = ("continue with checkpoint.keep=1 (the older checkpoints then go before the next save; "
                  "the newest stays until it is replaced), or free space there")
    else:
        advice = f"free at least {need - max(at_keep_1, free + reclaim):,} more bytes there (or move the run directory)"
    return (f"not enough free space for the next checkpoint under {root}: it needs {need:,} bytes, "
            f"{free:,} are free{freed}"), [], advice


def check_space_at_start(run_dir: Path, keep: int) -> None:
    """A continuation on a disk that cannot hold its next checkpoint (as large as its newest) is one
    error before anything is trained or written."""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return  # a fresh run: check_space_for_first_checkpoint, once the model's size is known
    problem = make_room(Path(run_dir) / CHECKPOINT_DIR, folder_bytes(newest), keep, "at the start (nothing trained)",
                        newest)
    if problem:
        raise CheckpointError(problem)


def check_space_for_first_checkpoint(run_dir: Path, need: int) -> None:
    """A fresh run on a disk that cannot hold one checkpoint (`need`: its tensors' bytes, known from
    the config) is one error before anything is written: else it would train, with interval=0 to
    the end, and lose it all at the save."""
    root = Path(run_dir) / CHECKPOINT_DIR
    try:
        free = free_bytes(root)
    except OSError:
        return  # a folder that cannot be read: the run directory's own checks say why
    if free >= need + MARGIN_BYTES:
        return
    raise CheckpointError(
        f"not enough free space for the run's first checkpoint under {root}: the model's weights and optimizer "
        f"state take {need:,} bytes ({need + MARGIN_BYTES:,} with the checkpoint's other files), {free:,} are "
        f"free, at the start (nothing written); free at least {need + MARGIN_BYTES - free:,} more bytes there "
        "or put the run directory on a disk with room (hydra.run.dir=)"
    )


def make_room(root: Path, need: int, keep: int, when: str, newest: Path | None, pending: Path | None = None,
              say: Callable[[str], None] | None = None, step: int | None = None) -> str | None:
    """Rank 0 of a run: None when a checkpoint of `need` bytes fits, else the one-line problem naming
    `when` and `newest`. `say` (just before a save): remove what retention lets go first if that
    makes room, saying so."""
    try:
        problem, early, advice = room_problem(root, need, keep, pending, step)
    except OSError:
        return None  # a folder that cannot be read: the save itself says why
    if say is not None:
        for path in early:
            say(f"removing {path.name} first to make room for the next checkpoint (checkpoint.keep={keep})")
            remove_checkpoint(path)
    if problem is None:
        return None
    newest_text = f"the newest checkpoint {newest} is intact" if newest else "no checkpoint was written yet"
    return f"{problem}, {when}; {newest_text}; {advice}; the same command then continues"
