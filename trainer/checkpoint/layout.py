"""Names of a checkpoint's files and folders, and finding the complete checkpoints of a run.

Standard library only (no torch, no numpy): the run-directory checks use it before torch is
imported, so a user's mistake is reported in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

from trainer.errors import CheckpointError

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
METADATA_FILE = ".metadata"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
DEL_PREFIX = ".del_"
# A published checkpoint that failed verification is renamed `corrupt_step_NNNNNN` (kept for
# inspection, never deleted, never counted by retention or resumed).
CORRUPT_PREFIX = "corrupt_"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a `step_NNNNNN` folder name, or None for any other name."""
    name = Path(path).name
    if not name.startswith(STEP_PREFIX):
        return None
    try:
        return int(name[len(STEP_PREFIX):])
    except ValueError:
        return None


def is_complete(path: Path) -> bool:
    """A published checkpoint: its marker and DCP index are both there."""
    path = Path(path)
    return (path / MARKER).is_file() and (path / METADATA_FILE).is_file()


def has_marker(path: Path) -> bool:
    """Its save finished: the marker is only written once every file is in place."""
    return (Path(path) / MARKER).is_file()


def marked_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders of a `checkpoints/` folder that carry a marker (complete or damaged since),
    newest step first: the candidates a resume verifies in turn."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir() and has_marker(p)]
    return [p for _, p in sorted(((s, p) for s, p in found if s is not None), reverse=True)]


def corrupt_dir(ckpt: Path) -> Path:
    """Where a corrupt checkpoint is moved: `corrupt_<name>`, with `.1`, `.2` ... if that is taken."""
    ckpt = Path(ckpt)
    base = ckpt.with_name(CORRUPT_PREFIX + ckpt.name)
    dest, n = base, 0
    while dest.exists():
        n += 1
        dest = base.with_name(f"{base.name}.{n}")
    return dest


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (a `step_*` or `.tmp_*` save, or a run's `checkpoints/` folder) that
    `path` is or lies inside, else None: a folder where only saves write, so that what a resume
    verifies and retention removes is never mixed with other files."""
    for folder in (Path(path).absolute(), *Path(path).absolute().parents):
        named_as_save = checkpoint_step(folder) is not None or folder.name.startswith(TMP_PREFIX)
        if named_as_save and (folder.parent.name == CHECKPOINT_DIR or has_marker(folder)):
            return folder
        if folder.name == CHECKPOINT_DIR and folder.is_dir() and any(
                checkpoint_step(child) is not None for child in folder.iterdir()):
            return folder
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints in a `checkpoints/` folder, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (or of a `checkpoints/` folder), or None."""
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == CHECKPOINT_DIR and not (run_dir / CHECKPOINT_DIR).is_dir() else (
        run_dir / CHECKPOINT_DIR
    )
    found = list_checkpoints(root)
    return found[-1] if found else None


def has_checkpoint(run_dir: Path, complete: bool = True) -> bool:
    """Whether the run directory holds a checkpoint (a complete one, unless complete=False)."""
    if not complete:
        root = run_dir / CHECKPOINT_DIR
        return root.is_dir() and any(p.name.startswith(STEP_PREFIX) for p in root.iterdir())
    return latest_checkpoint(run_dir) is not None


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint folder from what a user typed: a `step_*` folder, a `checkpoints/` folder, or a
    run directory (its newest checkpoint). Raises CheckpointError naming what is wrong."""
    path = Path(spec).expanduser()
    if is_complete(path):
        return path
    if path.is_dir():
        if checkpoint_step(path) is not None and has_marker(path):
            raise CheckpointError(
                f"checkpoint {path} is corrupt (missing {METADATA_FILE}, though its save finished); "
                "resume from an earlier step_* folder or the run directory"
            )
        if checkpoint_step(path) is not None or path.name.startswith(TMP_PREFIX):
            raise CheckpointError(
                f"{path} is an incomplete checkpoint (no {MARKER} marker: its save was interrupted); "
                "resume from an earlier step_* folder or the run directory"
            )
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        raise CheckpointError(
            f"{path} holds no complete checkpoint; pass a run directory with checkpoints/step_*, "
            "or one of those step_* folders"
        )
    if path.exists():
        raise CheckpointError(
            f"{path} is a file, not a checkpoint; pass a run directory with checkpoints/step_*, "
            "or one of those step_* folders"
        )
    raise CheckpointError(
        f"checkpoint {path} does not exist; pass a run directory with checkpoints/step_*, "
        "or one of those step_* folders"
    )
