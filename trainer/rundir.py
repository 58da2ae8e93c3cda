"""The run directory: what counts as another run's outputs, and the resolved config record."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.env import restart_count
from trainer.errors import UserError
from trainer.metrics import METRICS_FILE

CONFIG_RECORD = "resolved_config.json"
CHECKPOINT_DIR = "checkpoints"


def has_checkpoint(run_dir: Path, complete: bool = True) -> bool:
    """Whether the run directory holds a checkpoint (a complete one, unless complete=False)."""
    ckpt = run_dir / CHECKPOINT_DIR
    if not complete:
        return ckpt.is_dir() and any(p.name.startswith("step_") for p in ckpt.iterdir())
    from trainer.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir) is not None


def check_run_dir(run_dir: Path, resume: str) -> None:
    """Refuse to start where another run already wrote, unless this run is resuming it.

    resume=auto continues the newest complete checkpoint of run_dir; resume=never refuses a run
    directory with outputs; resume=PATH must name a complete checkpoint (or a run directory with
    one). A restarted attempt of the same elastic job (TORCHELASTIC_RESTART_COUNT > 0) always
    continues its own outputs.
    """
    if restart_count() > 0:
        return
    if resume not in ("auto", "never"):
        from trainer.checkpoint import resolve_checkpoint

        resolve_checkpoint(resume)  # raises CheckpointError naming what is wrong with PATH
        return
    if not (run_dir / METRICS_FILE).exists() and not has_checkpoint(run_dir, complete=False):
        return
    if resume == "never":
        raise UserError(
            f"run directory {run_dir} already holds a run's outputs and resume=never; "
            "choose another hydra.run.dir= or remove that directory"
        )
    if not has_checkpoint(run_dir):
        raise UserError(
            f"run directory {run_dir} already holds another run's outputs (metrics.jsonl, no complete "
            "checkpoint to resume); choose another hydra.run.dir= or remove that directory"
        )


def write_config_record(run_dir: Path, cfg_dict: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (CONFIG_RECORD + ".tmp")
    tmp.write_text(json.dumps(cfg_dict, indent=2, sort_keys=True))
    tmp.replace(run_dir / CONFIG_RECORD)


def read_config_record(run_dir: Path) -> dict:
    path = run_dir / CONFIG_RECORD
    if not path.exists():
        raise UserError(
            f"{run_dir} is not a dtrain run directory (no {CONFIG_RECORD}); pass a run's output folder"
        )
    return json.loads(path.read_text())
