"""What runs and sweeps achieved: the figures a run's metrics.jsonl holds, the status files of a
sweep's points, the results table that sweeps and `dtrain report` print, and the table of a run's
lm-evaluation-harness scores (`dtrain eval RUN_DIR --tasks ...` writes them, `dtrain report` shows them)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from trainer.config.keys import NOT_IDENTITY
from trainer.errors import UserError
from trainer.io import flock_held
from trainer.observe.metrics import METRICS_FILE, read_metrics

STATUS_FILE = "status.json"
HARNESS_FILE = "eval_harness.json"
def finite_or_none(value: Any) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


# What `dtrain eval RUN_DIR` writes beside the run (trainer/commands/eval.py).
HELLASWAG_RESULT_FILE = "eval_hellaswag.json"


def evaluated_hellaswag(run_dir: Path) -> float | None:
    """acc_norm from the run's `dtrain eval` result file, when it has one."""
    try:
        record = json.loads((Path(run_dir) / HELLASWAG_RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return finite_or_none(record.get("hellaswag_acc_norm")) if isinstance(record, dict) else None


def run_figures(run_dir: Path, records: list[dict[str, Any]] | None = None) -> tuple[bool, dict[str, Any]]:
    """What a run's metrics.jsonl (or its already read `records`) says: whether the run finished,
    and its final train loss, best val loss, last HellaSwag acc_norm (from training's evaluations,
    else from `dtrain eval`'s result file), tokens/s, wall time, steps and tokens (None where not
    recorded)."""
    if records is None:
        records = read_metrics(run_dir / METRICS_FILE)
    end = next((r for r in reversed(records) if isinstance(r.get("summary"), dict)), None)
    summary = None if end is None else end["summary"]
    train = [r for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if finite_or_none(r.get("val_loss")) is not None]
    bpbs = [r["val_bpb"] for r in records if finite_or_none(r.get("val_bpb")) is not None]
    hellaswag = [r["hellaswag_acc_norm"] for r in records if finite_or_none(r.get("hellaswag_acc_norm")) is not None]
    figures: dict[str, Any] = {
        "steps": max((r.get("step", 0) for r in records), default=0),
        "tokens": max((r.get("tokens", 0) for r in records), default=0),
        "final_loss": finite_or_none(train[-1]["loss"]) if train else None,
        "best_val_loss": min(vals) if vals else None,
        "final_val_loss": vals[-1] if vals else None,
        "final_val_bpb": bpbs[-1] if bpbs else None,
        "hellaswag_acc_norm": hellaswag[-1] if hellaswag else evaluated_hellaswag(run_dir),
        "tokens_per_s": None,
        "train_tokens_per_s": None,
        "wall_s": None,
        **target_figures(None if end is None else end.get("target")),
    }
    if summary is not None:
        for key in ("final_loss", "best_val_loss", "tokens_per_s", "train_tokens_per_s", "wall_s", "steps", "tokens"):
            if finite_or_none(summary.get(key)) is not None:
                figures[key] = summary[key]
    elif train:
        rates = [r["tokens_per_s"] for r in train if finite_or_none(r.get("tokens_per_s")) is not None]
        figures["tokens_per_s"] = sum(rates) / len(rates) if rates else None
    return summary is not None, figures


def target_figures(target: Any) -> dict[str, Any]:
    """The summary's `target` record (trainer/fit/target.py) as figures: whether the run reached its
    train.target_val_loss, and the training seconds, tokens, step and FLOPs it took (None where the
    run had no target or did not reach it)."""
    target = target if isinstance(target, dict) else {}
    reached = target.get("reached") if target else None
    figures = {"target_reached": reached}
    for key in ("train_s", "tokens", "step", "flops"):
        figures[f"target_{key}"] = finite_or_none(target.get(key)) if reached else None
    return figures


def _target_cell(record: dict[str, Any]) -> str:
    if record.get("target_reached") is None:
        return "-"
    if not record["target_reached"]:
        return "not reached"
    return f"{_fmt(record.get('target_train_s'), '.1f')} s\n{_fmt(record.get('target_tokens'), ',.0f')} tok"


def read_status(point_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((point_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def live_status(point_dir: Path) -> dict[str, Any] | None:
    """A sweep point's status as it stands now: a point recorded as running whose folder no live
    process holds (its sweep holds it while the point runs: trainer.launch.sweep.run_point) was killed
    without a word (kill -9, the out-of-memory killer, a lost node), whatever the file says."""
    status = read_status(point_dir)
    if status is None or status.get("status") != "running" or flock_held(point_dir):
        return status
    pid = status.get("pid")
    return {**status, "status": "killed",
            "error": f"its sweep{f' (pid {pid})' if pid else ''} ended while it ran, without recording how "
                     "(kill -9, out of memory, a lost node); the same sweep command resumes it"}


def point_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's point folders (those with a status file or a metrics.jsonl), by job number."""
    if not sweep_dir.is_dir():
        return []
    found = [p for p in sweep_dir.iterdir()
             if p.is_dir() and ((p / STATUS_FILE).exists() or (p / METRICS_FILE).exists())]
    return sorted(found, key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))


def read_overrides(run_dir: Path) -> list[str]:
    """A run's command-line overrides, from Hydra's .hydra/overrides.yaml (empty when absent)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    try:
        return [str(o) for o in OmegaConf.load(path)]
    except Exception:
        return []


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


STATUS_STYLE = {"ok": "green", "failed": "bold red", "killed": "bold red", "skipped": "yellow", "running": "yellow",
                "interrupted": "yellow", "unfinished": "yellow"}


def results_table(records: list[dict[str, Any]], title: str) -> Table:
    """One row per run/point: overrides, status, final train loss, best val loss, last val bits per
    byte, HellaSwag, tok/s, wall."""
    names = [Path(r.get("run_dir", "?")).name for r in records]
    row_labels, shared = labels([r.get("overrides") or [] for r in records], names)
    caption = f"overrides of every row: {' '.join(shared)}" if shared else None
    table = Table(title=title, caption=caption, caption_justify="left")
    columns = (("#", "right"), ("overrides", "left"), ("status", "left"), ("train loss", "right"),
               ("best val", "right"), ("val bpb", "right"), ("HellaSwag", "right"), ("tok/s", "right"),
               ("wall", "right"))
    with_target = any(r.get("target_reached") is not None for r in records)
    if with_target:  # train.target_val_loss: training seconds and tokens to it
        columns += (("to target", "right"),)
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("overrides", "status"))
    for record, label, name in zip(records, row_labels, names):
        status = record.get("status", "?")
        style = STATUS_STYLE.get(status, "")
        target = (_target_cell(record),) if with_target else ()
        table.add_row(
            str(record["num"]) if record.get("num") is not None else name,
            label.replace(" ", "\n") if label != name else "-",  # one override a line
            f"[{style}]{status}[/]" if style else status,
            _fmt(record.get("final_loss"), ".4f"),
            _fmt(record.get("best_val_loss"), ".4f"),
            _fmt(record.get("final_val_bpb"), ".4f"),
            _fmt(record.get("hellaswag_acc_norm"), ".4f"),
            _fmt(record.get("tokens_per_s"), ",.0f"),
            "-" if record.get("wall_s") is None else f"{record['wall_s']:.1f} s",
            *target,
        )
    return table


def table_console() -> Console:
    """A console for result tables: the terminal's width, or 140 columns when output goes to a
    file or a pipe (rich's default of 80 folds the overrides column)."""
    console = Console()
    return console if console.is_terminal else Console(width=140)


def harness_table(record: dict[str, Any], title: str) -> Table:
    """One row per task and metric of an eval_harness.json record: the harness's `results` mapping
    ({"task": {"acc,none": 0.31, "acc_stderr,none": 0.02, "alias": ...}}), its versions and n-samples."""
    table = Table(title=title, caption=f"step {record.get('step')}: {record.get('checkpoint')}",
                  caption_justify="left")
    for name, justify in (("task", "left"), ("version", "right"), ("n", "right"), ("metric", "left"),
                          ("filter", "left"), ("value", "right"), ("± stderr", "right")):
        table.add_column(name, justify=justify)
    versions = record.get("versions") or {}
    samples = record.get("n-samples") or {}
    for task, metrics in (record.get("results") or {}).items():
        first = True
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            n = (samples.get(task) or {}).get("effective")
            table.add_row(
                metrics.get("alias", task) if first else "",
                str(versions.get(task, "-")) if first else "",
                str(n) if first and n is not None else "",
                metric, filt, _number(value), _number(stderr),
            )
            first = False
    return table


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value in (None, "N/A") else str(value)
    if not math.isfinite(value):
        return str(value)
    return format(value, ".4f") if abs(value) < 1e4 else format(value, ",.0f")  # perplexities get large


def read_harness(run_dir: Path) -> dict[str, Any] | None:
    """A run's eval_harness.json, or None when it has none."""
    path = Path(run_dir) / HARNESS_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({type(err).__name__}); score the run again with "
                        "dtrain eval RUN_DIR --tasks ...") from None
