"""The run directory: what counts as another run's outputs, and the resolved config record.

Torch-free (the CLI checks a run directory before torch is imported, so a mistake is reported fast).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.checkpoint.layout import has_checkpoint, resolve_checkpoint
from trainer.env import restart_count
from trainer.errors import UserError
from trainer.io import write_atomic
from trainer.metrics import METRICS_FILE
from trainer.writable import check_writable_dir

CONFIG_RECORD = "resolved_config.json"


def check_run_dir(run_dir: Path, resume: str) -> None:
    """Refuse to start where another run already wrote, unless this run is resuming it.

    resume=auto continues the newest complete checkpoint of run_dir; resume=never refuses a run
    directory with outputs; resume=PATH must name a complete checkpoint (or a run directory with
    one). A restarted attempt of the same elastic job (TORCHELASTIC_RESTART_COUNT > 0) always
    continues its own outputs.
    The folder must be writable (see trainer.writable.check_writable_dir).
    """
    check_writable_dir(run_dir, f"run directory {run_dir}", "choose another hydra.run.dir=")
    if restart_count() > 0:
        return
    if resume not in ("auto", "never"):
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
    write_atomic(run_dir / CONFIG_RECORD, json.dumps(cfg_dict, indent=2, sort_keys=True), mode=_new_file_mode())


def _new_file_mode() -> int:
    """The permissions a plain new file gets under this process's umask (mkstemp's would be 0600;
    the record stays readable by whoever could read it before)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def read_config_record(run_dir: Path) -> dict:
    path = run_dir / CONFIG_RECORD
    if not path.exists():
        raise UserError(
            f"{run_dir} is not a dtrain run directory (no {CONFIG_RECORD}); pass a run's output folder"
        )
    return json.loads(path.read_text())
