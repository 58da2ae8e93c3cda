"""Checks and preparation done once, before any worker starts: a bad input fails here, cleanly,
before anything is written to the run directory (and before torch is imported)."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console

from trainer.checkpoint.layout import has_checkpoint
from trainer.checkpoint.space import check_space_at_start
from trainer.config.batch import batch_plan, rank_factor
from trainer.config.schema import to_dict, tracker_names
from trainer.config.validation import validate
from trainer.data.hints import prepare_command
from trainer.data.in_use import hold_for_reading
from trainer.data.layout import as_data_cfg, dataset_dir, val_token_count
from trainer.data.mixture import check_mixture_data, mixture_weights
from trainer.data.shard_reader import open_split
from trainer.errors import DataError
from trainer.evals.hellaswag_file import check_hellaswag_file
from trainer.observe.metrics import require_tracker
from trainer.preflight.continuation import check_continuation, check_same_data
from trainer.preflight.run_tokenizer import Pin, unpinned
from trainer.preflight.rundir import RunDirLock, RunDirState, check_run_dir, write_config_record
from trainer.prepare.pipeline import check_prepared_source, check_source, is_prepared, prepare
from trainer.process.env import restart_count
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.init_source import check_init_source


def check_run(cfg, run_dir: Path, world: int, lock: RunDirLock | None = None) -> RunDirState:
    """Validate the config, the run directory, the data, the tokenizer, HellaSwag's file and the
    trackers' packages;
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
    check_data(cfg, world, lock, continues=resumes)
    check_same_data(cfg, run_dir, continued)  # the data and tokenizer it trained with
    if state is not RunDirState.FINISHED:
        check_space_at_start(run_dir, cfg.checkpoint.keep)
    load_tokenizer(cfg.tokenizer)  # readable (GPT-2's fetched once) before the run directory exists
    check_hellaswag_file(cfg)  # HellaSwag during training: its file there (or fetched) first
    for name in tracker_names(cfg.logger):
        require_tracker(name)
    for note in notes:
        _say(note)
    return state


def check_data(cfg, world: int, lock: RunDirLock | None = None, prepare_now: bool = True,
               continues: bool = False) -> None:
    """The data of a run, as far as it is known without its run directory: data.max_tokens keeps
    enough for one step, the dataset is prepared (now, with data.auto_prepare), its manifest is
    whole, and a shard of each split holds one step (the loader never lets a step span two shards).
    `lock`: the run directory's, which then holds the dataset folder against a re-prepare for the
    run's life. A sweep checks each point's before its sweep folder is made, without `prepare_now`:
    a point that prepares its data when it starts has only its source checked, where that needs
    no download. A mixture (data.mix) reads datasets prepared on their own: each is checked, none
    prepared. A data.source the command names must be the one its dataset was prepared from and,
    for a run that starts afresh, unchanged on disk since; a run that `continues` from a checkpoint
    reads the data as prepared (its checkpoint's data identity is checked, continuation.py)."""
    plan = batch_plan(cfg, world)
    train_need = plan.total_batch_size + 1
    # validation reads whole sequences, at least one (trainer/data/val_set.py)
    val_need = plan.seq_len + 1 if _validates(cfg) else 0
    if mixture_weights(cfg.data):
        hold = None if lock is None else lambda folder: lock.hold(hold_for_reading(folder))
        check_mixture_data(cfg, val_need, hold)
        return
    check_prepared_source(cfg.data, files=not continues)
    if cfg.data.auto_prepare:
        _check_max_tokens(cfg.data, train_need, val_need)
        if prepare_now:
            if not is_prepared(cfg.data, files=not continues):  # seconds to minutes of tokenizing: say so
                Console(stderr=True).print(f"dtrain: preparing dataset {cfg.data.name!r} on first use "
                                           f"(data.auto_prepare; `{prepare_command(cfg.data)}` does it ahead)",
                                           highlight=False, soft_wrap=True)
            prepare(cfg.data, files=not continues)  # a quick no-op once prepared with the same settings
        elif not is_prepared(cfg.data):
            check_source(cfg.data)
            return
    data_folder = dataset_dir(as_data_cfg(cfg.data))
    if lock is not None and data_folder.is_dir():
        lock.hold(hold_for_reading(data_folder))
    train = open_split(cfg.data, "train")
    train_tokens = sum(len(s) for s in train)
    if train_tokens < train_need:
        raise DataError(
            f"dataset {cfg.data.name!r} has {train_tokens:,} training tokens but one optimizer step needs "
            f"{train_need:,} (micro_batch_size x seq_len x {rank_factor(plan.dp_world, world)} x accumulation); "
            "lower the batch or world"
        )
    _check_largest_shard(cfg, "train", train, train_need, rank_factor(plan.dp_world, world),
                         "lower the batch or world, or prepare with a larger data.shard_tokens")
    if cfg.data.val_fraction > 0:
        val = open_split(cfg.data, "val")
        if val_need:
            _check_largest_shard(cfg, "val", val, val_need, "", "raise data.val_fraction and prepare again, "
                                 "set train.val_tokens=0 to train without validation, or lower train.seq_len")


def _validates(cfg) -> bool:
    return cfg.data.val_fraction > 0 and cfg.train.val_tokens > 0


def _check_largest_shard(cfg, split: str, shards, need: int, ranks: str, fix: str) -> None:
    """`ranks`: the step's rank factor (rank_factor), for the train split's message."""
    have = max((len(s) for s in shards), default=0)
    if have < need:
        t = cfg.train
        per, made_of = ("validation sequence", f"seq_len {t.seq_len}") if split == "val" else (
            "optimizer step", f"micro_batch_size {t.micro_batch_size} x seq_len {t.seq_len} x {ranks} "
                              "x accumulation")
        raise DataError(
            f"the {split} split of dataset {cfg.data.name!r} holds at most {have:,} tokens per shard but one {per} "
            f"needs {need:,} ({made_of}, +1); {fix}"
        )


def _check_max_tokens(data_cfg, train_need: int, val_need: int) -> None:
    """data.max_tokens caps the dataset prepare writes: refused, naming the value that fits one
    optimizer step and one validation sequence, when it cannot (the stream is cut into splits as
    prepare cuts it: round(total x val_fraction) tokens, at least one, go to validation)."""
    cap = data_cfg.max_tokens
    if cap is None:
        return
    fraction = data_cfg.val_fraction

    def val_tokens(total: int) -> int:
        return val_token_count(total, fraction)

    def fits(total: int) -> bool:
        return total - val_tokens(total) >= train_need and val_tokens(total) >= val_need

    if fits(cap):
        return
    least = max(train_need + val_need, math.ceil(train_need / (1 - fraction)) - 1,
                math.ceil((val_need - 0.5) / fraction) if fraction > 0 else 0)  # then a few steps to round's edge
    while not fits(least):
        least += 1
    and_val = f" and one validation sequence {val_need:,}" if val_need else ""
    raise DataError(
        f"data.max_tokens={cap} leaves {cap - val_tokens(cap):,} training and {val_tokens(cap):,} validation tokens, "
        f"but one optimizer step needs {train_need:,}{and_val}; "
        f"set data.max_tokens={least} or more (or null for all)"
    )


def record_config(cfg, run_dir: Path, pin: Pin | None = None) -> None:
    """resolved_config.json, with a line when it replaces a different record (trainer.preflight.claim's
    last step). `pin`: the tokenizer a continuation pinned to a checkpoint's copy, not recorded as a
    setting (run_tokenizer.py)."""
    note = write_config_record(run_dir, unpinned(to_dict(cfg), pin))
    if note:
        _say(note)


def say_notice(line: str) -> None:
    """One `dtrain: ...` line on stderr."""
    _say(line)


def _say(line: str) -> None:
    Console(stderr=True).print(f"dtrain: {line}", highlight=False, soft_wrap=True)
