"""Checks and preparation done once, before any worker starts: a bad input fails here, cleanly,
before anything is written to the run directory (and before torch is imported)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from trainer.checkpoint.continuation import check_continuation, check_same_data
from trainer.checkpoint.init_source import check_init_source
from trainer.checkpoint.layout import has_checkpoint
from trainer.checkpoint.space import check_space_at_start
from trainer.config import batch_plan, to_dict, tracker_names
from trainer.data.in_use import hold_for_reading
from trainer.data.layout import dataset_dir
from trainer.data.prepare import as_data_cfg, prepare
from trainer.data.shards import open_split
from trainer.data.tokenizer import gpt2_encoding
from trainer.env import restart_count
from trainer.errors import DataError
from trainer.metrics import require_tracker
from trainer.rundir import RunDirLock, RunDirState, check_run_dir, write_config_record
from trainer.validation import validate


def check_run(cfg, run_dir: Path, world: int, lock: RunDirLock | None = None) -> RunDirState:
    """Validate the config, the run directory, the data, the tokenizer and the trackers' packages;
    returns what the run directory holds for this run (new, to continue, or finished). `lock`, the
    run directory's, also holds the dataset folder against a re-prepare for the run's life."""
    validate(cfg)
    state = check_run_dir(run_dir, cfg.resume, to_dict(cfg))
    continued, notes = None, []
    if state is RunDirState.CONTINUE and cfg.resume == "auto" and restart_count() == 0:
        # the trajectory keys and global batch the checkpoint it resumes was saved with
        continued, notes = check_continuation(cfg, run_dir, world)
    # The source matters only to a run that starts afresh: a continuation resumes its own checkpoint.
    resumes = cfg.resume not in ("auto", "never") or has_checkpoint(run_dir)
    if cfg.model.init_from and not resumes:
        check_init_source(cfg.model.init_from, cfg.model)
    if cfg.data.auto_prepare:
        prepare(cfg.data)  # a quick no-op once prepared with the same settings
    data_folder = dataset_dir(as_data_cfg(cfg.data))
    if lock is not None and data_folder.is_dir():
        lock.hold(hold_for_reading(data_folder))
    plan = batch_plan(cfg, world)
    train_tokens = sum(len(s) for s in open_split(cfg.data, "train"))
    need = plan.total_batch_size + 1
    if train_tokens < need:
        raise DataError(
            f"dataset {cfg.data.name!r} has {train_tokens:,} training tokens but one optimizer step needs "
            f"{need:,} (micro_batch_size x seq_len x world {world} x accumulation); lower the batch or world"
        )
    if cfg.data.val_fraction > 0:
        open_split(cfg.data, "val")
    check_same_data(cfg, run_dir, continued)  # the data and tokenizer it trained with
    if state is not RunDirState.FINISHED:
        check_space_at_start(run_dir, cfg.checkpoint.keep)
    if cfg.train.sample_tokens > 0:
        gpt2_encoding()
    for name in tracker_names(cfg.logger):
        require_tracker(name)
    for note in notes:
        _say(note)
    return state


def preflight(cfg, run_dir: Path, world: int, lock: RunDirLock,
              check_launch: Callable[[object, int, Path], None]) -> RunDirState:
    """Every check under the run directory's lock (`check_launch`: the caller's checks that need
    torch, which this module does not import), then (unless the run is finished) the directory
    claimed and the resolved config recorded; returns what the run directory held."""
    lock.probe()
    state = check_run(cfg, run_dir, world, lock)
    if state is not RunDirState.FINISHED:
        check_launch(cfg, world, run_dir)
        lock.claim()
        record_config(cfg, run_dir)
    return state


def record_config(cfg, run_dir: Path) -> None:
    note = write_config_record(run_dir, to_dict(cfg))
    if note:
        _say(note)


def _say(line: str) -> None:
    Console(stderr=True).print(f"dtrain: {line}", highlight=False, soft_wrap=True)
