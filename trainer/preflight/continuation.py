"""A continuation checked against what the run was, not only against its keys.

Every checkpoint records what the trajectory depends on: the run's resolved config (its
trajectory keys: trainer/config/keys.py), the global batch in tokens (and the micro batch, sequence
length, accumulation and world it came from), the data's identity and the tokenizer the manifest
names (trainer/data/identity.py). The same command run again in the run directory (resume=auto) is
checked against the checkpoint that resume will load: the newest one that verifies, as
selection.choose_own picks it (records.py), so a damaged newest checkpoint is never the reason a
check is skipped. A changed trajectory key, global batch or data is one `error:` line naming the way
to continue on the same terms, or `resume=PATH` to continue on new terms on purpose; another world
size, mode or device mesh (parallel.dp_replicate, parallel.tp: layout keys, like world)
that keeps the global batch continues (accumulation is derived again; only the data-parallel ranks
count in the batch).

Torch-free: it runs before anything is written or imported.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.checkpoint.layout import CHECKPOINT_DIR, CONFIG_FILE
from trainer.checkpoint.records import Resumable, newest_resumable
from trainer.config.batch import batch_plan, rank_factor
from trainer.config.keys import BATCH_KEYS
from trainer.config.schema import to_dict
from trainer.data.identity import data_changes, recorded_identity
from trainer.data.mixture import describe_data
from trainer.errors import ConfigError, DataError
from trainer.io import dotted_keys
from trainer.preflight.rundir import CONFIG_RECORD, check_same_run, read_record, trajectory_changes


def check_continuation(cfg, run_dir: Path, world: int) -> tuple[Resumable | None, list[str]]:
    """The checkpoint resume=auto will load, checked against this command's trajectory keys and
    global batch (the data is checked once prepared: check_same_data); returns it (None when the run
    has none: it starts over from step 0) and the lines to print once every check has passed."""
    chosen = newest_resumable(run_dir / CHECKPOINT_DIR)
    if chosen is None:
        return None, []
    config, record = to_dict(cfg), read_record(run_dir)
    notes = []
    if record is None:  # the run's record is gone: the checkpoint's is the next one
        check_same_run(run_dir, chosen.config, config, source=chosen.ckpt / CONFIG_FILE)
    elif changed := trajectory_changes(chosen.config, config, skip=BATCH_KEYS):
        # The record agrees with this command (check_run_dir), the checkpoint does not: a resume=PATH
        # continued it with new settings on purpose and rewrote the record, then stopped before saving.
        was, now = dotted_keys(chosen.config), dotted_keys(config)
        shown = ", ".join(f"{k} {json.dumps(was.get(k))} -> {json.dumps(now.get(k))}" for k in changed)
        notes.append(f"continuing {chosen.ckpt.name} with the settings {CONFIG_RECORD} records since a resume= "
                     f"changed them: {shown}")
    _check_global_batch(cfg, world, run_dir, chosen, record)
    return chosen, notes


def check_same_data(cfg, run_dir: Path, chosen: Resumable | None) -> None:
    """The prepared data and its tokenizer against what the checkpoint to be resumed recorded."""
    if chosen is None:
        return
    # A checkpoint from before these were recorded: the data.* keys were compared as trajectory keys.
    changes = data_changes(chosen.state, recorded_identity(cfg.data))
    if changes:
        raise DataError(
            f"{describe_data(cfg.data)} is not the data the run in {run_dir} trained on "
            f"({_named(chosen)}): {'; '.join(changes)}; prepare the data it trained on again to continue it, "
            f"resume={run_dir} to continue on the new data on purpose, or choose another hydra.run.dir="
        )


def _named(chosen: Resumable) -> str:
    """The checkpoint's name, and why it is not the newest when newer ones are corrupt."""
    if not chosen.passed_over:
        return chosen.ckpt.name
    newer = ", ".join(f"{err.ckpt.name}: {err.reason}" for err in chosen.passed_over)
    return f"{chosen.ckpt.name}, the newest intact checkpoint, which resume=auto loads; corrupt: {newer}"


def recorded_batch(chosen: Resumable, record: dict | None) -> tuple[int, str] | None:
    """The global batch the run trained with and what it was made of, from the first source that has
    it: the checkpoint's trainer state, the batch arithmetic of its config at the data-parallel size
    it saved, that of the run's resolved_config.json; None when none does."""
    state = chosen.state
    world = state.get("world")
    # A checkpoint from before the device mesh: every rank was data-parallel.
    dp_world = state.get("dp_world", world)
    parts = [state.get(k) for k in ("micro_batch_size", "seq_len", "grad_accum_steps")]
    if _is_count(state.get("total_batch_size")):
        if not all(map(_is_count, [*parts, dp_world, world])):
            return state["total_batch_size"], ""
        micro, seq, accum = parts
        return state["total_batch_size"], f" = {micro} x {seq} x {rank_factor(dp_world, world)} x {accum} accumulation"
    for source in (chosen.config, record):
        train = (source or {}).get("train")
        if isinstance(train, dict) and _is_count(dp_world):
            total = _total_batch(train, dp_world)
            if total is not None:
                return total, f" (from its config at {rank_factor(dp_world, world)})"
    return None



def _total_batch(train: dict, dp_world: int) -> int | None:
    total, micro, seq, accum = (train.get(k) for k in ("total_batch_size", "micro_batch_size", "seq_len",
                                                       "grad_accum_steps"))
    if _is_count(total):
        return total
    if _is_count(micro) and _is_count(seq) and (accum is None or _is_count(accum)):
        return micro * seq * dp_world * (accum or 1)
    return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_global_batch(cfg, world: int, run_dir: Path, chosen: Resumable, record: dict | None) -> None:
    plan = batch_plan(cfg, world)
    recorded = recorded_batch(chosen, record)
    if recorded is None:
        raise ConfigError(
            f"the run in {run_dir} records no global batch ({_named(chosen)} and {CONFIG_RECORD} hold none), so "
            f"this command's {plan.total_batch_size:,} tokens cannot be checked against it; resume={run_dir} "
            "continues it with this command's batch on purpose, or choose another hydra.run.dir="
        )
    total, made_of = recorded
    if plan.total_batch_size == total:
        return
    raise ConfigError(
        f"the run in {run_dir} trained with a global batch of {total:,} tokens{made_of} "
        f"({_named(chosen)}), this command's is {plan.total_batch_size:,} = {plan.micro_batch_size} x {plan.seq_len} "
        f"x {rank_factor(plan.dp_world, world)} x {plan.grad_accum_steps} accumulation; add "
        f"train.total_batch_size={total} to continue it on the same terms (accumulation is derived again), "
        f"resume={run_dir} to continue with the new batch on purpose, or choose another hydra.run.dir="
    )
