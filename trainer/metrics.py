"""Rank 0's outputs: metrics.jsonl, the rich progress bar, and the end-of-run summary table."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from trainer.errors import ConfigError
from trainer.io import write_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# The package each tracker writes with (the optional extra dtrain[<name>] installs it).
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def require_tracker(name: str) -> None:
    """The package the tracker `name` writes with is installed (checked before a run starts)."""
    module = TRACKER_MODULES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"logger={name} needs the {module} package; run pip install 'dtrain[{name}]' "
            f"or drop {name} from logger="
        )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _json_safe(value: Any) -> Any:
    """`null` for a NaN or inf (JSON has neither; Python's json would write bare NaN tokens)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class MetricsLogger:
    """Appends one JSON object per log line; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int = 0, sinks=()):
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self._file = None
        self.sinks = list(sinks)  # experiment trackers (trainer/trackers.py) get every record too
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step or self.path.exists():
            self._truncate_after(resume_step)
        self._file = self.path.open("a", buffering=1)

    def _truncate_after(self, step: int) -> None:
        """Drop lines past the resumed step, so a resume logs no step twice and none is missing, and
        an end-of-run summary: the continued run ends anew and logs its own, the only one."""
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step and "summary" not in r]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: (round(v, 7) if isinstance(v, float) and math.isfinite(v) else _json_safe(v))
                  for k, v in record.items()}
        record.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        for sink in self.sinks:
            sink.log(record)

    def rewind(self, step: int) -> None:
        """Drop the lines past `step` (a rollback to a checkpoint at `step`), as a resume does."""
        if self._file is not None:
            self._file.close()
            self._truncate_after(step)
            self._file = self.path.open("a", buffering=1)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []


class ProgressView:
    """Rank 0's live progress bar: loss, lr, tokens/s and ETA."""

    def __init__(self, enabled: bool, total_steps: int, start_step: int, bar: bool = True):
        self.console = Console(stderr=False)
        self.enabled = enabled  # rank 0 prints; the others stay silent
        self._progress = None
        if not (enabled and bar):
            return
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not sys.stdout.isatty(),
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
        self._progress.start()

    def update(self, step: int, status: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)

    def print(self, message: str) -> None:
        """A line that stays above the bar (also the only output when stdout is not a terminal)."""
        if self.enabled:
            self.console.print(message, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def summary_table(title: str, rows: dict[str, str]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, value)
    return table
