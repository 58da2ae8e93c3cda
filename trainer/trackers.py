"""Experiment trackers that receive every metrics.jsonl record on rank 0 (metrics.jsonl itself is
always written). A tracker is a sink: `log(record)` and `close()`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from trainer.metrics import TENSORBOARD_DIR, require_tracker


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars of every record as TensorBoard events in <run dir>/tensorboard/."""

    def __init__(self, run_dir: Path, resume_step: int = 0):
        require_tracker("tensorboard")
        # an optional extra (and it loads torch's writer): imported only for runs that use it
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard hides events at steps >= purge_step (the resumed step itself is kept), as
        # metrics.jsonl drops the lines past it.
        purge_step = resume_step + 1 if resume_step else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def open_trackers(logger: str, run_dir: Path, resume_step: int) -> list[Sink]:
    """The sinks `logger=` asks for (jsonl alone: none)."""
    return [TensorBoardSink(run_dir, resume_step)] if logger == "tensorboard" else []
