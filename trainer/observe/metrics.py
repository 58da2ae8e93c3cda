"""Rank 0's outputs: metrics.jsonl, the progress bar or step lines, and the end-of-run summary table."""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from trainer.errors import ConfigError
from trainer.io import write_atomic
from trainer.process.joblog import LOG, rank_lines_wanted

METRICS_FILE = "metrics.jsonl"
UNBOUNDED_WIDTH = 1 << 16  # columns a table may measure itself in off a terminal (print_whole)
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
        self.sinks = list(sinks)  # experiment trackers (trainer/observe/trackers.py) get every record too
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
        # The trackers first: a continuation takes every step in metrics.jsonl as sent to them
        # (trackers.py's already_sent), so a kill between the two writes must not leave a line here
        # that they lack (its step would be missing there for good). The other way round it leaves a
        # step they have and this file lacks, sent again: the window is one line's write.
        for sink in self.sinks:
            sink.log(record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

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
    """What a run shows as it goes. Rank 0: on a terminal with train.progress on, the live bar (loss,
    lr, tokens/s, ETA); otherwise (a pipe, a file, nohup, Slurm, or train.progress=false) one plain
    line per logged step on stdout. Either way every line, the step lines included, goes to the job
    log (trainer.process.joblog). Other ranks print their own lines (prefixed `rank N: `) only when dtrain's
    launcher started them (trainer.process.joblog.RANK_LINES_ENV): into their log files under <run dir>/logs,
    or, for local rank 0 of a further node, onto that node's output."""

    def __init__(self, rank: int, total_steps: int, start_step: int, bar: bool = True):
        self.console = Console(stderr=False)
        self.enabled = rank == 0  # rank 0 shows the run; the others at most their own step lines
        self.total_steps = total_steps
        self.terminal = sys.stdout.isatty()
        self._progress = None
        self._prefix = "" if self.enabled else f"rank {rank}: "
        show_bar = self.enabled and bar and self.terminal
        self.lines = not show_bar and (self.enabled or rank_lines_wanted())
        if not show_bar:
            return
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
        self._progress.start()

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, mfu: float | None,
               eta_s: float | None, extra: str = "") -> None:
        """A logged step: the bar's status, or a plain line (`step 5/20 | loss ... | eta 0:01:02`);
        `extra` (a MoE model's ` | aux ... | load ...`) follows the loss."""
        status = f"loss {loss:.4f}{extra} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
        if mfu is not None:
            status += f" | mfu {mfu:.1%}"
        line = f"step {step}/{self.total_steps} | {status} | eta {_clock(eta_s)}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        elif self.lines:
            # flushed: a pipe or a redirected worker's file would otherwise hold it until a block fills
            print(self._prefix + line, flush=True)
        if self.enabled:
            LOG.info(line)

    def rank_line(self, message: str) -> None:
        """A line of a rank other than 0 for its own log file (nothing elsewhere)."""
        if self.lines and not self.enabled:
            print(self._prefix + message, flush=True)

    def print(self, message: str) -> None:
        """A line above the bar, or between the step lines (rich markup), also in the job log."""
        if self.enabled:
            # soft_wrap off a terminal: rich would break long lines at 80 columns in a log
            self.console.print(message, highlight=False, soft_wrap=not self.terminal)
            LOG.info(Text.from_markup(message).plain)

    def summary(self, title: str, rows: dict[str, str]) -> None:
        """The end-of-run table, nothing cut (print_whole); the job log gets it as one line."""
        if self.enabled:
            print_whole(self.console, summary_table(title, rows))
            LOG.info(f"{title}: " + " | ".join(f"{key} {value}" for key, value in rows.items()))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _clock(seconds: float | None) -> str:
    """h:mm:ss, as the bar's columns show time ("-" while unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))


def summary_table(title: str, rows: dict[str, str]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a value too wide for a terminal wraps in its cell, never "…"
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def print_whole(console: Console, table: Table) -> None:
    """`table` with nothing cut. Off a terminal (a pipe, a file, `| tee`) rich lays everything out in
    80 columns and would end a long value, the run directory above all, with "…": there the table
    gets its natural width instead. On a terminal a value wider than the screen wraps in its cell."""
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(UNBOUNDED_WIDTH), table).maximum
        console = Console(file=console.file, width=max(console.width, natural))
    console.print(table)
