"""Sweeps (`dtrain train -m ...`): one status file per point, `summary.jsonl`, re-runs that skip
finished points and resume unfinished ones, and the table printed at the end.

Each point of a sweep is a full run (distributed when world > 1) in Hydra's sweep subfolder
`<sweep dir>/<job num>/`. Around every point, `run_point` writes `<point>/status.json`
(running -> ok | failed | skipped) and rebuilds `<sweep dir>/summary.jsonl` from the status
files, so a sweep that is killed still has a summary of the points it finished. Running the same
sweep command with the same `hydra.sweep.dir=` again skips the points that finished (their
metrics.jsonl ends with the run's `summary` record) and runs the others again: from their newest
checkpoint when they have one (resume=auto), from the start when they have none.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from rich.console import Console
from rich.table import Table

from trainer.errors import UserError
from trainer.metrics import METRICS_FILE, read_metrics

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.jsonl"
ERROR_FILE = "error.txt"
PREVIOUS_ATTEMPT = "previous_attempt"
# Overrides that steer the sweep itself (or Hydra) and do not change what a point trains.
NOT_IDENTITY = ("sweep.", "hydra.", "hydra/")


class SweepPointFailed(CompactHydraException):
    """Raised by a failed point so Hydra records it as failed and prints this one line (no traceback)."""


class _SweepState:
    """What this driver process knows about the sweep it is running (the basic launcher runs every
    point in this process, one after another)."""

    failed_point: int | None = None


STATE = _SweepState()


# --- the figures of one run -------------------------------------------------------------------
def finite_or_none(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def run_figures(run_dir: Path) -> dict[str, Any]:
    """What metrics.jsonl says about a run: finished?, final train loss, best val loss, last
    HellaSwag acc_norm, tokens/s, wall time, steps, tokens (None where not recorded)."""
    records = read_metrics(run_dir / METRICS_FILE)
    summary = next((r["summary"] for r in reversed(records) if isinstance(r.get("summary"), dict)), None)
    train = [r for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if finite_or_none(r.get("val_loss")) is not None]
    hellaswag = [r["hellaswag_acc_norm"] for r in records if finite_or_none(r.get("hellaswag_acc_norm")) is not None]
    figures: dict[str, Any] = {
        "finished": summary is not None,
        "steps": max((r.get("step", 0) for r in records), default=0),
        "tokens": max((r.get("tokens", 0) for r in records), default=0),
        "final_loss": finite_or_none(train[-1]["loss"]) if train else None,
        "best_val_loss": min(vals) if vals else None,
        "hellaswag_acc_norm": hellaswag[-1] if hellaswag else None,
        "tokens_per_s": None,
        "wall_s": None,
    }
    if summary is not None:
        for key in ("final_loss", "best_val_loss", "tokens_per_s", "wall_s", "steps", "tokens"):
            if finite_or_none(summary.get(key)) is not None:
                figures[key] = summary[key]
    elif train:
        rates = [r["tokens_per_s"] for r in train if finite_or_none(r.get("tokens_per_s")) is not None]
        figures["tokens_per_s"] = sum(rates) / len(rates) if rates else None
    return figures


# --- status files and summary.jsonl ----------------------------------------------------------
def read_status(point_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((point_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_status(point_dir: Path, status: dict[str, Any]) -> None:
    point_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(point_dir / STATUS_FILE, json.dumps(status, indent=2) + "\n")


def point_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's point folders (those with a status file or a metrics.jsonl), by job number."""
    if not sweep_dir.is_dir():
        return []
    found = [p for p in sweep_dir.iterdir()
             if p.is_dir() and ((p / STATUS_FILE).exists() or (p / METRICS_FILE).exists())]
    return sorted(found, key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))


def sweep_records(sweep_dir: Path) -> list[dict[str, Any]]:
    records = []
    for point in point_dirs(sweep_dir):
        status = read_status(point)
        if status is None:  # a run folder without a status file (e.g. copied in): describe it
            figures = run_figures(point)
            status = {"num": int(point.name) if point.name.isdigit() else None,
                      "overrides": read_overrides(point),
                      "status": "ok" if figures.pop("finished") else "unfinished", **figures}
        status["run_dir"] = str(point.resolve())
        records.append(status)
    return records


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rebuild <sweep dir>/summary.jsonl from the points' status files (one line per point)."""
    records = sweep_records(sweep_dir)
    if records or (sweep_dir / SUMMARY_FILE).exists():
        write_text_atomic(sweep_dir / SUMMARY_FILE, "".join(json.dumps(r) + "\n" for r in records))
    return records


def read_overrides(run_dir: Path) -> list[str]:
    """A run's command-line overrides, from Hydra's .hydra/overrides.yaml (empty when absent)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    from omegaconf import OmegaConf

    try:
        return [str(o) for o in OmegaConf.load(path)]
    except Exception:
        return []


def identity(overrides: list[str]) -> list[str]:
    """The overrides that decide what a point trains (sweep.* settings excluded)."""
    return [o for o in overrides if not o.lstrip("+~").startswith(NOT_IDENTITY)]


# --- one point --------------------------------------------------------------------------------
def is_head_node() -> bool:
    """Only the first node of a multi-node point writes the sweep's files (one Slurm task per node)."""
    return os.environ.get("SLURM_PROCID", "0") == "0"


def run_point(cfg, hydra_cfg, runner: Callable[[], dict]) -> float:
    """Run one sweep point (Hydra's task function calls this in multirun mode); returns the
    objective, the best val loss. A finished point is skipped, an unfinished one resumed."""
    from trainer.checkpoint.layout import has_checkpoint

    point_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_dir = point_dir.parent
    num = int(hydra_cfg.job.num)
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    head = is_head_node()
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    previous = read_status(point_dir)
    if previous is not None and identity(previous.get("overrides", [])) != identity(overrides):
        raise SweepPointFailed(
            f"{point_dir} holds another sweep's point #{num} "
            f"({_difference(previous['overrides'], overrides)}); "
            "give this sweep its own hydra.sweep.dir= or remove that folder"
        )
    base = {"num": num, "overrides": overrides}
    figures = run_figures(point_dir)
    if figures.pop("finished"):
        best = figures["best_val_loss"]
        if head:
            wall = (previous or {}).get("wall_s", figures["wall_s"])
            write_status(point_dir, {**base, "status": "ok", **figures, "wall_s": wall, "error": None})
            write_summary(sweep_dir)
        console.print(f"[green]sweep point #{num} finished earlier[/] (best val loss "
                      f"{'-' if best is None else f'{best:.4f}'}); skipping it")
        return math.inf if best is None else float(best)
    if STATE.failed_point is not None and cfg.sweep.fail_fast:
        if head:
            write_status(point_dir, {**base, "status": "skipped", "error":
                                     f"not run: point #{STATE.failed_point} failed and sweep.fail_fast=true"})
            write_summary(sweep_dir)
        raise SweepPointFailed(f"sweep point #{num} not run: point #{STATE.failed_point} failed "
                               "(sweep.fail_fast=true)")
    if head:
        if not has_checkpoint(point_dir):
            _set_aside_previous_attempt(point_dir)
        elif previous is not None:
            console.print(f"[yellow]sweep point #{num} is unfinished; resuming it from its checkpoint[/]")
        write_status(point_dir, {**base, "status": "running", "started": time.time()})
        write_summary(sweep_dir)
    t0 = time.perf_counter()
    try:
        result = runner()
    except BaseException as err:
        wall = time.perf_counter() - t0
        interrupted = isinstance(err, KeyboardInterrupt)
        message = "interrupted" if interrupted else (str(err).strip() or type(err).__name__)
        first_line = _headline(message)
        if head:
            details = "" if interrupted else "\n" + "".join(traceback.format_exception(err))
            (point_dir / ERROR_FILE).write_text(message + "\n" + details)
            figures = run_figures(point_dir)
            figures.pop("finished")
            write_status(point_dir, {**base, "status": "interrupted" if interrupted else "failed",
                                     **figures, "wall_s": wall, "error": first_line})
            write_summary(sweep_dir)
        if not isinstance(err, Exception):
            raise
        STATE.failed_point = num if STATE.failed_point is None else STATE.failed_point
        console.print(f"[bold red]sweep point #{num} failed:[/] {first_line}")
        raise SweepPointFailed(
            f"sweep point #{num} failed: {first_line} (details: {point_dir / ERROR_FILE})"
        ) from err
    wall = time.perf_counter() - t0
    figures = run_figures(point_dir)
    figures.pop("finished")
    best = figures["best_val_loss"]
    if best is None and finite_or_none(result.get("best_val_loss")) is not None:
        best = figures["best_val_loss"] = result["best_val_loss"]
    if head:
        write_status(point_dir, {**base, "status": "ok", **figures, "wall_s": wall, "error": None})
        write_summary(sweep_dir)
    return math.inf if best is None else float(best)


def _headline(message: str) -> str:
    """One line for the table: the message's first line, and when that only introduces a
    traceback ("worker rank 0 failed (exit code 1):"), the exception line at its end too."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:
        head = f"{head} {lines[-1]}"
    return head[:500]


def _set_aside_previous_attempt(point_dir: Path) -> None:
    """A point that failed before its first checkpoint starts again from step 0: move the old
    attempt's metrics (and event files) out of the way, into <point>/previous_attempt/."""
    names = (METRICS_FILE, "tensorboard", ERROR_FILE)
    stale = [point_dir / name for name in names if (point_dir / name).exists()]
    if not stale:
        return
    import shutil

    target = point_dir / PREVIOUS_ATTEMPT
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in stale:
        path.replace(target / path.name)


# --- the driver: before and after the sweep ---------------------------------------------------
def check_sweep_dir(sweep_dir: Path, points: list[list[str]]) -> None:
    """Before anything runs: refuse a sweep dir whose points were made by a different sweep."""
    for num, point in enumerate(points):
        status = read_status(sweep_dir / str(num))
        if status is not None and identity(status.get("overrides", [])) != identity(point):
            raise UserError(
                f"{sweep_dir} holds another sweep (point #{num}: "
                f"{_difference(status.get('overrides', []), point)}); a re-run must repeat the same "
                "overrides; choose another hydra.sweep.dir= or remove that folder"
            )


def _difference(theirs: list[str], ours: list[str]) -> str:
    only_theirs = [o for o in identity(theirs) if o not in ours]
    only_ours = [o for o in identity(ours) if o not in theirs]
    return (f"there: {' '.join(only_theirs) or '-'}; this command: {' '.join(only_ours) or '-'}"
            if only_theirs or only_ours else "the same overrides in another order")


def short_override(override: str) -> str:
    """`optim.lr=0.0007518878431841926` -> `optim.lr=0.0007519` (for labels; files keep the exact value)."""
    key, sep, value = override.partition("=")
    try:
        number = float(value)
    except ValueError:
        return override
    digits = sum(c.isdigit() for c in value.lstrip("+-0.").split("e")[0].split("E")[0])
    return f"{key}{sep}{number:.4g}" if sep and digits > 6 and math.isfinite(number) else override


def labels(overrides_per_run: list[list[str]], fallback: list[str]) -> tuple[list[str], list[str]]:
    """A short label per run (the overrides that differ between runs) and the shared overrides."""
    sets = [set(o) for o in overrides_per_run]
    common = set.intersection(*sets) if sets else set()
    out = []
    for overrides, name in zip(overrides_per_run, fallback):
        varying = [short_override(o) for o in overrides if o not in common and not o.startswith(NOT_IDENTITY)]
        out.append(" ".join(varying) if varying else name)
    shared = [o for o in overrides_per_run[0] if o in common] if overrides_per_run else []
    return out, shared


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


STATUS_STYLE = {"ok": "green", "failed": "bold red", "skipped": "yellow", "running": "yellow",
                "interrupted": "yellow", "unfinished": "yellow"}


def results_table(records: list[dict[str, Any]], title: str) -> Table:
    """One row per run/point: overrides, status, final train loss, best val loss, HellaSwag, tok/s, wall."""
    names = [Path(r.get("run_dir", "?")).name for r in records]
    row_labels, shared = labels([r.get("overrides") or [] for r in records], names)
    caption = f"overrides of every row: {' '.join(shared)}" if shared else None
    table = Table(title=title, caption=caption, caption_justify="left")
    columns = (("#", "right"), ("overrides", "left"), ("status", "left"), ("train loss", "right"),
               ("best val", "right"), ("HellaSwag", "right"), ("tok/s", "right"), ("wall", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("overrides", "status"))
    for record, label, name in zip(records, row_labels, names):
        status = record.get("status", "?")
        style = STATUS_STYLE.get(status, "")
        table.add_row(
            str(record["num"]) if record.get("num") is not None else name,
            label.replace(" ", "\n") if label != name else "-",  # one override a line
            f"[{style}]{status}[/]" if style else status,
            _fmt(record.get("final_loss"), ".4f"),
            _fmt(record.get("best_val_loss"), ".4f"),
            _fmt(record.get("hellaswag_acc_norm"), ".4f"),
            _fmt(record.get("tokens_per_s"), ",.0f"),
            "-" if record.get("wall_s") is None else f"{record['wall_s']:.1f} s",
        )
    return table


def table_console() -> Console:
    """A console for result tables: the terminal's width, or 140 columns when output goes to a
    file or a pipe (rich's default of 80 folds the overrides column)."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


def finish_sweep(sweep_dir: Path, console: Console | None = None) -> list[dict[str, Any]]:
    """After the sweep (finished, failed or interrupted): rebuild summary.jsonl, print the table."""
    records = write_summary(sweep_dir)
    if not records:
        return records
    console = console or table_console()
    console.print(results_table(records, f"sweep {sweep_dir}"))
    for r in records:
        if r.get("status") != "ok" and r.get("error"):
            console.print(f"[{STATUS_STYLE.get(r.get('status'), '')}]#{r.get('num')} {r.get('status')}:[/] "
                          f"{r['error']}", highlight=False, soft_wrap=True)
    counts: dict[str, int] = {}
    for r in records:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    console.print(f"{len(records)} points: " + ", ".join(f"{n} {s}" for s, n in counts.items())
                  + f" | {sweep_dir / SUMMARY_FILE} | plots: dtrain report {sweep_dir}", highlight=False)
    return records


def pin_sweep_dir(args: list[str]) -> tuple[list[str], Path | None]:
    """Resolve the sweep dir once in the driver (its `${now:}` included) and pass it to Hydra
    explicitly, so this process knows where the points go; refuse a sweep dir that holds another
    sweep's points. Returns the arguments for Hydra and the sweep dir."""
    from omegaconf import OmegaConf

    from trainer.cli import _sweep_points, compose, split_args

    overrides, multirun = split_args(args)
    printing = any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in args)
    if not multirun or printing or "RANK" in os.environ:
        return args, None
    points = _sweep_points(overrides)
    cfg = compose(points[0] if points else [], return_hydra_config=True)
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        value = str(sweep_dir).replace("'", "\\'")
        # beside the other overrides: Hydra's argparse takes them as one run of positionals
        at = args.index(overrides[0]) if overrides else 0
        args = [*args[:at], f"hydra.sweep.dir='{value}'", *args[at:]]
    raw = OmegaConf.to_container(cfg.hydra, resolve=False)
    basic = raw.get("sweeper", {}).get("_target_", "").endswith("BasicSweeper")
    if basic and raw.get("sweep", {}).get("subdir") == "${hydra.job.num}":
        check_sweep_dir(sweep_dir, points)
    return args, sweep_dir


PLUGINS = {"hydra/sweeper/optuna": "optuna", "hydra/launcher/submitit": "slurm"}


@contextlib.contextmanager
def plugin_hint():
    """Name the optional extra to install when a config asks for a Hydra plugin that is missing."""
    try:
        yield
    except UserError as err:
        for needle, extra in PLUGINS.items():
            if f"'{needle}" in str(err):
                raise UserError(f"{needle.split('/')[-1]} is a Hydra plugin that is not installed: "
                                f"pip install 'dtrain[{extra}]'") from None
        raise
