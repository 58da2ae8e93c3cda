"""Checks and preparation done once, before any worker starts: a bad input fails here, cleanly,
before anything is written to the run directory (and before torch is imported)."""

from __future__ import annotations

from pathlib import Path

from trainer.config import batch_plan, to_dict, validate
from trainer.data.prepare import prepare
from trainer.data.shards import open_split
from trainer.data.tokenizer import gpt2_encoding
from trainer.errors import DataError
from trainer.metrics import require_tracker
from trainer.rundir import check_run_dir, write_config_record


def check_run(cfg, run_dir: Path, world: int) -> None:
    """Validate the config, the run directory, the data, the tokenizer and the logger's package."""
    validate(cfg)
    check_run_dir(run_dir, cfg.resume)
    if cfg.data.auto_prepare:
        prepare(cfg.data)  # a quick no-op once prepared with the same settings
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
    if cfg.train.sample_tokens > 0:
        gpt2_encoding()
    require_tracker(cfg.logger)


def preflight(cfg, run_dir: Path, world: int) -> None:
    """Every check, then the resolved config recorded in the run directory."""
    check_run(cfg, run_dir, world)
    write_config_record(run_dir, to_dict(cfg))
