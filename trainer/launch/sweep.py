"""Sweeps (`dtrain train -m ...`): one status file per point, `summary.jsonl`, re-runs that skip
finished points and resume unfinished ones, and the table printed at the end.

Each point of a sweep is a full run (distributed when world > 1) in Hydra's sweep subfolder
`<sweep dir>/<job num>/`. Around every point, `run_point` writes `<point>/status.json`
(running -> ok | failed | skipped) and rebuilds `<sweep dir>/summary.jsonl` from the status
files, so a sweep that is killed still has a summary of the points it finished. Running the same
sweep command again (into the same folder: by default one named by its overrides, keys.py's
sweep_identity) skips the points that finished (their metrics.jsonl ends with the run's `summary`
record) and runs the others again: from their newest checkpoint when they have one (resume=auto),
from the start when they have none.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict
from rich.console import Console

from trainer.checkpoint.layout import has_checkpoint
from trainer.config.command_line import config_source, split_args
from trainer.config.compose import OneLineJobError, compose, sweep_points
from trainer.config.keys import identity
from trainer.errors import Stopped, UserError
from trainer.io import check_writable_dir, folder_setting, write_atomic
from trainer.observe.metrics import METRICS_FILE, TENSORBOARD_DIR
from trainer.observe.results import (
    STATUS_FILE,
    STATUS_STYLE,
    finite_or_none,
    live_status,
    point_dirs,
    read_overrides,
    read_status,
    results_table,
    run_figures,
    table_console,
)
from trainer.observe.stats import seed_statistics
from trainer.preflight.rundir import RunDirLock
from trainer.process.env import under_torchrun

SUMMARY_FILE = "summary.jsonl"
ERROR_FILE = "error.txt"
PREVIOUS_ATTEMPT = "previous_attempt"


class SweepPointFailed(OneLineJobError):
    """Raised by a failed point so Hydra records it as failed and prints this one line (no traceback)."""


class _SweepState:
    """What this driver process knows about the sweep it is running (the basic launcher runs every
    point in this process, one after another)."""

    failed_point: int | None = None


STATE = _SweepState()


# --- status files and summary.jsonl ----------------------------------------------------------
def sweep_records(sweep_dir: Path) -> list[dict[str, Any]]:
    records = []
    for point in point_dirs(sweep_dir):
        status = live_status(point)
        if status is None:  # a run folder without a status file (e.g. copied in): describe it
            finished, figures = run_figures(point)
            status = {"num": int(point.name) if point.name.isdigit() else None,
                      "overrides": read_overrides(point),
                      "status": "ok" if finished else "unfinished", **figures}
        status["run_dir"] = str(point.resolve())
        records.append(status)
    return records


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rebuild <sweep dir>/summary.jsonl from the points' status files (one line per point)."""
    records = sweep_records(sweep_dir)
    if records or (sweep_dir / SUMMARY_FILE).exists():
        write_atomic(sweep_dir / SUMMARY_FILE, "".join(json.dumps(r) + "\n" for r in records))
    return records


# --- one point --------------------------------------------------------------------------------
def is_head_node() -> bool:
    """Only the first node of a multi-node point writes the sweep's files (one Slurm task per node)."""
    return os.environ.get("SLURM_PROCID", "0") == "0"


class _Point:
    """One point's folder and identity; `record` writes its status file and the sweep's summary
    (on the head node only)."""

    def __init__(self, hydra_cfg):
        self.dir = Path(hydra_cfg.runtime.output_dir)
        self.num = int(hydra_cfg.job.num)
        self.overrides = [str(o) for o in hydra_cfg.overrides.task]
        self.head = is_head_node()

    def record(self, status: str, fields: dict[str, Any]) -> None:
        if not self.head:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"num": self.num, "overrides": self.overrides, "status": status, **fields}, indent=2)
        write_atomic(self.dir / STATUS_FILE, text + "\n")
        write_summary(self.dir.parent)


def run_point(cfg, hydra_cfg, runner: Callable[[RunDirLock | None], dict]) -> float:
    """Run one sweep point (Hydra's task function calls this in multirun mode); returns the
    objective, the best val loss. A finished point is skipped, an unfinished one resumed.

    The point's folder is locked (rundir.RunDirLock) before its status is read and held until its
    last status is written, so a live point is never touched by another process, and a point
    recorded as running whose folder nobody holds was killed (results.live_status). `runner`
    trains under that lock."""
    point = _Point(hydra_cfg)
    lock = RunDirLock(point.dir)
    # Under plain torchrun every rank runs the sweep: rank 0's worker holds each point (trainer.fit.worker).
    locking = not under_torchrun()
    if locking:
        try:
            lock.probe()
        except UserError as err:
            raise SweepPointFailed(f"sweep point #{point.num} not run: {err}") from None
    try:
        return _run_point(cfg, point, lock if locking else None, runner)
    finally:
        lock.release()


def _run_point(cfg, point: _Point, lock: RunDirLock | None, runner: Callable[[RunDirLock | None], dict]) -> float:
    num = point.num
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    previous = read_status(point.dir)
    if previous is not None and identity(previous.get("overrides", [])) != identity(point.overrides):
        raise SweepPointFailed(
            f"{point.dir} holds another sweep's point #{num} "
            f"({_difference(previous['overrides'], point.overrides)}); "
            "give this sweep its own hydra.sweep.dir= or remove that folder"
        )
    finished, figures = run_figures(point.dir)
    if finished:
        best = figures["best_val_loss"]
        point.record("ok", {**figures, "wall_s": _wall(figures, (previous or {}).get("wall_s")), "error": None})
        console.print(f"[green]sweep point #{num} finished earlier[/] (best val loss "
                      f"{'-' if best is None else f'{best:.4f}'}); skipping it")
        return math.inf if best is None else float(best)
    if STATE.failed_point is not None and cfg.sweep.fail_fast:
        point.record("skipped", {"error": f"not run: point #{STATE.failed_point} failed and sweep.fail_fast=true"})
        raise SweepPointFailed(f"sweep point #{num} not run: point #{STATE.failed_point} failed "
                               "(sweep.fail_fast=true)")
    if point.head:
        if not has_checkpoint(point.dir):
            _set_aside_previous_attempt(point.dir)
        elif previous is not None:
            console.print(f"[yellow]sweep point #{num} is unfinished; resuming it from its checkpoint[/]")
    if lock is not None:
        lock.claim()
    point.record("running", {"started": time.time(), "pid": os.getpid()})
    t0 = time.perf_counter()
    try:
        result = runner(lock)
    except BaseException as err:
        wall = time.perf_counter() - t0
        interrupted = isinstance(err, (KeyboardInterrupt, Stopped))
        message = "interrupted" if interrupted else (str(err).strip() or type(err).__name__)
        first_line = _headline(message)
        if point.head:
            details = "" if interrupted else "\n" + "".join(traceback.format_exception(err))
            (point.dir / ERROR_FILE).write_text(message + "\n" + details)
        _, figures = run_figures(point.dir)
        point.record("interrupted" if interrupted else "failed", {**figures, "wall_s": wall, "error": first_line})
        if not isinstance(err, Exception):
            raise
        STATE.failed_point = num if STATE.failed_point is None else STATE.failed_point
        console.print(f"[bold red]sweep point #{num} failed:[/] {first_line}")
        raise SweepPointFailed(
            f"sweep point #{num} failed: {first_line} (details: {point.dir / ERROR_FILE})"
        ) from err
    wall = time.perf_counter() - t0
    _, figures = run_figures(point.dir)
    best = figures["best_val_loss"]
    if best is None and finite_or_none(result.get("best_val_loss")) is not None:
        best = figures["best_val_loss"] = result["best_val_loss"]
    point.record("ok", {**figures, "wall_s": _wall(figures, wall), "error": None})
    return math.inf if best is None else float(best)


def _wall(figures: dict[str, Any], attempt_s: float | None) -> float | None:
    """A finished point's wall time: its run's summary wall_s, every start's (a point resumed after a
    failure or a kill started more than once), the time its tokens/s is over; this attempt's seconds
    only where the run recorded none."""
    return figures["wall_s"] if figures.get("wall_s") is not None else attempt_s


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
    names = (METRICS_FILE, TENSORBOARD_DIR, ERROR_FILE)
    stale = [point_dir / name for name in names if (point_dir / name).exists()]
    if not stale:
        return
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


def finish_sweep(sweep_dir: Path, console: Console | None = None) -> list[dict[str, Any]]:
    """After the sweep (finished, failed or interrupted): rebuild summary.jsonl, print the table."""
    records = write_summary(sweep_dir)
    if not records:
        return records
    console = console or table_console()
    console.print(results_table(records, f"sweep {sweep_dir}"))
    finished = [r for r in records if r.get("status") == "ok"]
    _, seeds = seed_statistics(finished, identity, f"sweep {sweep_dir}: seeds (train.seed) per group")
    if seeds is not None:
        console.print(seeds, highlight=False, soft_wrap=True)
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
    """Resolve the sweep dir once in the driver (by default named by the sweep's overrides; a
    `${now:}` of the user's included) and pass it to Hydra explicitly, so this process knows where
    the points go; refuse a sweep dir that holds another sweep's points. Returns the arguments for
    Hydra and the sweep dir (None under plain torchrun, where every rank runs this: each pins the
    same folder, and rank 0's worker writes there)."""
    overrides, multirun = split_args(args)
    if not multirun:
        return args, None
    points = sweep_points(overrides)
    cfg = compose(points[0] if points else [], return_hydra_config=True, source=config_source(args))
    with open_dict(cfg):  # the sweep's overrides, as Hydra's multirun keeps them: they name its folder
        cfg.hydra.overrides.task = overrides
    folder_setting("hydra.sweep.dir", cfg.hydra.sweep.dir)  # not empty, no name too long
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    if not any(o.startswith("hydra.sweep.dir=") for o in overrides):
        value = str(sweep_dir).replace("'", "\\'")
        # beside the other overrides: Hydra's argparse takes them as one run of positionals
        at = args.index(overrides[0]) if overrides else 0
        args = [*args[:at], f"hydra.sweep.dir='{value}'", *args[at:]]
    if under_torchrun():
        return args, None
    check_writable_dir(sweep_dir, f"hydra.sweep.dir={sweep_dir}", "choose another hydra.sweep.dir=")
    raw = OmegaConf.to_container(cfg.hydra, resolve=False)
    basic = raw.get("sweeper", {}).get("_target_", "").endswith("BasicSweeper")
    if basic and raw.get("sweep", {}).get("subdir") == "${hydra.job.num}":
        check_sweep_dir(sweep_dir, points)
    return args, sweep_dir


class SweepDirLock(RunDirLock):
    """The sweep folder's lock, held by the sweep's driver for the sweep's life."""

    what = "sweep folder"
    holder = "dtrain sweep"
    choose = "hydra.sweep.dir="


@contextlib.contextmanager
def holding_sweep_dir(sweep_dir: Path | None) -> Iterator[None]:
    """One sweep per folder: a second start of a live sweep (the same command repeated with its
    hydra.sweep.dir=) is refused in one line naming the holder's pid, before anything is written.
    The head node holds it (the other nodes of a multi-node point write none of the sweep's files)."""
    if sweep_dir is None or not is_head_node():
        yield
        return
    lock = SweepDirLock(sweep_dir).probe()
    try:
        lock.claim()
        yield
    finally:
        lock.release()


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
