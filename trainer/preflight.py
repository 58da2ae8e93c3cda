"""Checks and preparation done once, before any worker starts: a bad input fails here, cleanly."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from trainer.config import batch_plan, to_dict, validate
from trainer.parallel import strategy_class
from trainer.rundir import check_run_dir, write_config_record


def preflight(cfg, run_dir: Path, world: int) -> None:
    """Validate the config, make sure data and tokenizer are ready, and record the config."""
    from trainer.data.prepare import prepare
    from trainer.data.shards import open_split
    from trainer.errors import DataError

    validate(cfg)
    check_run_dir(run_dir, cfg.resume)
    strategy = strategy_class(cfg.parallel.mode)
    if world == 1 and (strategy.shards_parameters or strategy.shards_optimizer_state):
        Console(stderr=True).print(
            f"[yellow]parallel={cfg.parallel.mode} with world=1 shards nothing; it runs, but use world>1 "
            "for its memory savings[/]"
        )
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
        from trainer.data.tokenizer import gpt2_encoding

        gpt2_encoding()
    if cfg.logger == "tensorboard":
        from trainer.tensorboard import require_tensorboard

        require_tensorboard()
    write_config_record(run_dir, to_dict(cfg))
