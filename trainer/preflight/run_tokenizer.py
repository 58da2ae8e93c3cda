"""A continuation reads its run's own tokenizer, wherever tokenizer.path points now.

A tokenizer=hf run names its tokenizer by a folder (tokenizer.path), but what a continuation must
read is the tokenizer the run trained with: its checkpoints record it (name, ids, end-of-text id,
fingerprint) and hold a copy of it (trainer/checkpoint/tokenizer_copy.py). While tokenizer.path
still holds it, nothing changes. When the folder was moved or its tokenizer rewritten since
(`dtrain tokenizer train --force`), the continuation reads the copy of the checkpoint it continues
instead: pin_run_tokenizer sets tokenizer.checkpoint, which the model's vocabulary, the dataset's
folder and every load of the tokenizer follow (trainer/config/vocab.py), so the same command goes on
as if nothing had moved, with one line saying so. The run's config record keeps the command's
settings (unpinned): where the tokenizer was read from is no setting of the run. A checkpoint
saved before copies were kept cannot stand in: one line names the tokenizer to put back.

Torch-free: it runs with the run's checks, before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import read_write

from trainer.checkpoint.layout import CHECKPOINT_DIR, latest_checkpoint, marked_checkpoints, resolve_checkpoint
from trainer.checkpoint.records import read_trainer_state
from trainer.checkpoint.tokenizer_copy import checkpoint_tokenizer, has_copy, recorded_tokenizer
from trainer.data.identity import tokenizer_changes
from trainer.data.manifest import describe_tokenizer
from trainer.errors import CheckpointError, DataError
from trainer.process.env import restart_count
from trainer.tokenizers.load import load_tokenizer


@dataclass(frozen=True)
class Pin:
    """tokenizer.checkpoint as a continuation set it, and the line that says why."""

    checkpoint: str
    note: str


def pin_run_tokenizer(cfg, run_dir: Path) -> Pin | None:
    """When `cfg` continues a tokenizer=hf run whose tokenizer.path no longer holds its tokenizer,
    set tokenizer.checkpoint to the newest checkpoint it continues from whose copy verifies, and
    return that; None when nothing needs pinning (a new run, GPT-2's tokenizer, the folder intact, a
    tokenizer.checkpoint given). DataError when no checkpoint holds a copy to stand in."""
    tok = cfg.tokenizer
    if tok.name != "hf" or tok.get("checkpoint"):
        return None
    candidates = _continued(cfg.resume, Path(run_dir))
    try:
        recorded = recorded_tokenizer(read_trainer_state(candidates[0])) if candidates else None
    except CheckpointError:
        return None  # unreadable: the continuation's own checks say what is wrong with it
    if recorded is None or recorded.get("tokenizer") != "hf":
        return None  # nothing to stand in for (a run of another tokenizer is the continuation's checks' to refuse)
    current = _identity(tok.path)
    if current is not None and not tokenizer_changes(recorded, current):
        return None
    now = ("holds no tokenizer now" if current is None
           else f"holds another tokenizer now ({describe_tokenizer(current)})")
    for ckpt in candidates:
        if not has_copy(ckpt):
            continue
        try:
            checkpoint_tokenizer(ckpt)  # the copy against its checksums and the checkpoint's record
        except (CheckpointError, DataError):
            continue  # a damaged copy: an older checkpoint's (the same run's tokenizer) stands in
        with read_write(cfg):
            cfg.tokenizer.checkpoint = str(ckpt)
        return Pin(str(ckpt), f"tokenizer.path={tok.path} {now}; the run continues with its own "
                              f"({describe_tokenizer(recorded)}), the copy in {ckpt}")
    raise DataError(f"tokenizer.path={tok.path} {now}, not the {describe_tokenizer(recorded)} the run in "
                    f"{candidates[0].parent.parent} trained with, and none of its checkpoints holds a copy of it "
                    f"(saved before checkpoints kept one); put that tokenizer back in {tok.path} to continue")


def unpinned(record: dict, pin: Pin | None) -> dict:
    """The config record of a run whose tokenizer a continuation pinned: the command's settings, with
    tokenizer.checkpoint as the command gave it (unset), not where this start read the tokenizer."""
    if pin is None:
        return record
    for section in (record.get("tokenizer"), (record.get("data") or {}).get("tokenizer")):
        if isinstance(section, dict) and section.get("checkpoint") == pin.checkpoint:
            section["checkpoint"] = None
    return record


def _continued(resume: str, run_dir: Path) -> list[Path]:
    """The checkpoints a continuation would load, in the order it tries them (as the Checkpointer
    chooses: a restarted attempt its own, resume=auto its own newest first, resume=PATH that one)."""
    own = run_dir / CHECKPOINT_DIR
    if restart_count() > 0 and latest_checkpoint(run_dir) is not None:
        return marked_checkpoints(own)
    if resume == "auto":
        return marked_checkpoints(own)
    if resume == "never":
        return []
    try:
        return [resolve_checkpoint(resume)]
    except CheckpointError:
        return []  # check_run_dir names what is wrong with resume=PATH


def _identity(path: str | None) -> dict | None:
    """The identity of the tokenizer a folder holds now, or None when it holds none it can read."""
    if not path:
        return None
    try:
        return load_tokenizer({"name": "hf", "path": path}).identity
    except DataError:
        return None
