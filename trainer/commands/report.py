"""`dtrain report PATH... [--out DIR]`: PNG figures and a summary table of runs or a sweep.

PATH is a run directory (it holds metrics.jsonl) or a sweep directory (its numbered subfolders are
runs). The figures put every run on the same axes, labelled by the overrides that differ between
them (read from each run's .hydra/overrides.yaml):

    loss.png          train loss and val loss against tokens seen
    lr.png            learning rate against tokens seen
    tokens_per_s.png  training throughput against tokens seen
    hellaswag.png     HellaSwag acc_norm against tokens seen (only when a run evaluated it)
    experts.png       a mixture-of-experts run's expert load (each MoE layer's least and most loaded
                      expert, as a share of the mean) and its load-balancing aux loss
                      (only when a run trained a MoE model: docs/model.md, "Mixture of experts")
    ranks.png         each rank's own time in the sampled steps of a multi-process run (one run: a
                      line per rank; several: each run's slowest rank over the others' median),
                      where a straggler shows (docs/troubleshooting.md, "Stragglers")
    report.json       runs that differ only in train.seed as groups: per group and figure n, mean,
                      sd, 95% CI; every group against the first (or --baseline) with the
                      difference, its 95% CI and Welch's t-test p-value (scipy: dtrain[stats])

A group of several seeds is drawn as its mean line and a band of +- one standard deviation.

A run scored with `dtrain eval RUN_DIR --tasks ...` also gets a table of its eval_harness.json
(lm-evaluation-harness: task, metric, value, stderr).

matplotlib is an optional extra: pip install 'dtrain[plot]'.
"""

from __future__ import annotations

import io
import json
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.layout import enclosing_checkpoint
from trainer.commands.args import ArgParser, folder_to_write
from trainer.config.keys import identity
from trainer.errors import UserError
from trainer.io import (
    check_room,
    check_writable_dir,
    new_file_mode,
    not_a_folder,
    write_atomic,
    write_errors_as_user_errors,
)
from trainer.observe.metrics import METRICS_FILE, read_metrics
from trainer.observe.results import (
    STATUS_FILE,
    finite_or_none,
    harness_table,
    labels,
    live_status,
    point_dirs,
    read_harness,
    read_overrides,
    results_table,
    run_figures,
    table_console,
)
from trainer.observe.stats import SEED_KEY, seed_statistics, without_seed
from trainer.observe.straggler_verdict import slowest_over_median

FIG_SIZE = (10, 5.5)  # inches at DPI: 1000 x 550 pixels
WIDE_FIG_SIZE = (14, 5.5)  # the two-panel loss figure: 1400 x 550 pixels
DPI = 100
REPORT_FILE = "report.json"


@dataclass
class RunData:
    """One run's curves and summary figures."""

    path: Path
    name: str
    overrides: list[str]
    record: dict[str, Any]
    train: list[dict] = field(default_factory=list)  # {"step","tokens","loss","lr",...,"tokens_per_s"}
    val: list[dict] = field(default_factory=list)  # {"step","tokens","val_loss"}
    hellaswag: list[dict] = field(default_factory=list)  # {"step","tokens","hellaswag_acc_norm",...}
    label: str = ""


def parse_args(argv: list[str]) -> tuple[list[Path], Path | None, str | None]:
    parser = ArgParser(prog="dtrain report", description=__doc__)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="a run directory, or a sweep directory whose subfolders are runs")
    parser.add_argument("--out", "-o", type=folder_to_write, metavar="DIR",
                        help="where the PNG files go (default: the single PATH)")
    parser.add_argument("--baseline", metavar="OVERRIDES",
                        help="compare every group of seeds with this one, named by its overrides "
                             "(e.g. --baseline optim=adamw); default: the first group")
    args = parser.parse_args(argv)
    if not args.paths:
        parser.error("give at least one run or sweep directory")
    if args.out is None and len(args.paths) > 1:
        raise UserError(f"{len(args.paths)} paths given: choose where the figures go with --out DIR")
    return args.paths, args.out, args.baseline


def find_runs(path: Path) -> list[Path]:
    """The run directories under PATH: PATH itself, or the points of a sweep directory."""
    if not path.is_dir():
        raise UserError(f"{path} {not_a_folder(path)}; give a run directory (it holds {METRICS_FILE}) "
                        "or a sweep directory (its subfolders are runs)")
    if (path / METRICS_FILE).exists():
        return [path]
    points = point_dirs(path)
    if not points:
        raise UserError(f"{path} holds no {METRICS_FILE} and no run subfolders; pass a run directory (e.g. "
                        "outputs/tiny-shakespeare-1a2b3c4d) or a sweep directory (e.g. multirun/optim.lr-1a2b3c4d)")
    return points


def load_run(path: Path, name: str) -> RunData:
    records = read_metrics(path / METRICS_FILE)
    overrides = read_overrides(path)
    status = live_status(path) if (path / STATUS_FILE).exists() else None
    finished, figures = run_figures(path, records)
    if status is not None:  # a sweep point: its own record (status, wall time, error)
        record = {**figures, **{k: v for k, v in status.items() if v is not None or k not in figures}}
        overrides = overrides or list(status.get("overrides", []))
    else:
        record = {"num": None, "status": "ok" if finished else "unfinished", **figures}
    record["overrides"] = overrides
    record["run_dir"] = str(path)
    return RunData(
        path=path,
        name=name,
        overrides=overrides,
        record=record,
        train=[r for r in records if "loss" in r and "tokens" in r],
        val=[r for r in records if finite_or_none(r.get("val_loss")) is not None and "tokens" in r],
        hellaswag=[r for r in records if finite_or_none(r.get("hellaswag_acc_norm")) is not None and "tokens" in r],
    )


def _smooth(values: list[float], points: int) -> list[float]:
    """Exponential moving average whose span grows with the number of points (none below 50)."""
    if points < 50:
        return values
    alpha = min(1.0, 20.0 / points)  # a span of ~5% of the run
    out, avg = [], values[0]
    for v in values:
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg)
    return out


def _short(label: str, width: int = 70) -> str:
    return label if len(label) <= width else label[: width - 3] + "..."


class Plotter:
    def __init__(self, runs: list[RunData], shared: list[str], out: Path):
        import matplotlib  # the optional extra dtrain[plot]: imported only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter

        self.plt, self.formatter = plt, EngFormatter(sep="")
        self.runs, self.out = runs, out
        # runs that differ only in train.seed are drawn as one group: its mean and spread
        self.groups: dict[tuple[str, ...], list[RunData]] = {}
        for run in runs:
            self.groups.setdefault(tuple(without_seed(identity(run.overrides))), []).append(run)
        self.rendered: dict[str, bytes] = {}  # file name -> PNG
        self.colors = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors
        self.shared = "common overrides: " + " ".join(shared) if shared else ""

    def _figure(self, title: str, panels: int = 1):
        size = WIDE_FIG_SIZE if panels > 1 else FIG_SIZE
        fig, axes = self.plt.subplots(1, panels, figsize=size, dpi=DPI, layout="constrained", squeeze=False,
                                      sharex=True)
        if self.shared:  # wrapped to the figure's width (~7.5 pixels a character at font size 9)
            title += "\n" + "\n".join(textwrap.wrap(self.shared, int(size[0] * DPI / 7.5)))
        fig.suptitle(title, fontsize=9 if self.shared else 12)
        for ax in axes[0]:
            ax.set_xlabel("tokens seen")
            ax.xaxis.set_major_formatter(self.formatter)
            ax.grid(True, alpha=0.3)
        return fig, list(axes[0])

    def _save(self, fig, name: str, axes) -> Path:
        """Render the figure into memory (self.rendered): the files are written together once every
        one is drawn and known to fit."""
        handles, names = axes[0].get_legend_handles_labels()
        if handles and (len(self.groups) > 1 or len(set(names)) > 1):
            axes[0].legend(fontsize=8, loc="best")
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DPI)
        self.plt.close(fig)
        self.rendered[name] = png.getvalue()
        return self.out / name

    def _line(self, ax, i: int, run: RunData, rows: list[dict], key: str, smooth: bool = False, **kw) -> bool:
        rows = [r for r in rows if finite_or_none(r.get(key)) is not None]
        if not rows:
            return False
        x = [r["tokens"] for r in rows]
        y = [r[key] for r in rows]
        color = self.colors[i % len(self.colors)]
        if smooth and len(y) >= 50:
            ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
            y = _smooth(y, len(y))
        ax.plot(x, y, color=color, label=_short(run.label), **kw)
        return True

    def _series(self, ax, i: int, group: list[RunData], rows_of, key: str, smooth: bool = False, **kw) -> bool:
        """One run's line, or for a group of seeds their mean line in a band of +- one sd (at the
        tokens every seed logged)."""
        if len(group) == 1:
            return self._line(ax, i, group[0], rows_of(group[0]), key, smooth=smooth, **kw)
        curves = [{r["tokens"]: r[key] for r in rows_of(run) if finite_or_none(r.get(key)) is not None}
                  for run in group]
        x = sorted(set.intersection(*(set(c) for c in curves)))
        if not x:
            return False
        mean = [statistics.fmean(c[t] for c in curves) for t in x]
        sd = [statistics.stdev(c[t] for c in curves) for t in x]
        if smooth and len(x) >= 50:
            mean, sd = _smooth(mean, len(x)), _smooth(sd, len(x))
        color = self.colors[i % len(self.colors)]
        label = " ".join(o for o in group[0].label.split() if not o.startswith(SEED_KEY + "=")) or "-"
        ax.fill_between(x, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                        color=color, alpha=0.2, linewidth=0)
        ax.plot(x, mean, color=color, label=_short(f"{label} (mean +- sd of {len(group)} seeds)"), **kw)
        return True

    def loss(self) -> Path:
        fig, (ax_train, ax_val) = self._figure("train and validation loss", panels=2)
        any_val = False
        for i, group in enumerate(self.groups.values()):
            self._series(ax_train, i, group, lambda r: r.train, "loss", smooth=True, linewidth=1.5)
            any_val |= self._series(ax_val, i, group, lambda r: r.val, "val_loss", marker="o", markersize=3,
                                    linewidth=1.5)
        ax_train.set_title("train loss")
        ax_val.set_title("val loss")
        for ax in (ax_train, ax_val):
            ax.set_ylabel("cross-entropy loss (nats)")
        if not any_val:
            ax_val.text(0.5, 0.5, "no validation loss recorded", ha="center", va="center",
                        transform=ax_val.transAxes, color="gray")
        return self._save(fig, "loss.png", [ax_train, ax_val])

    def experts(self) -> Path:
        """The expert load and aux loss of the MoE runs: with one run, each MoE layer's most (solid)
        and least (dashed) loaded expert, coloured by depth; with several, each run's extremes over
        its layers."""
        fig, (ax_load, ax_aux) = self._figure("mixture of experts: expert load and aux loss", panels=2)
        moe = [run for run in self.runs if any("expert_load" in r for r in run.train)]
        for i, run in enumerate(moe):
            rows = [r for r in run.train if "expert_load" in r]
            x = [r["tokens"] for r in rows]
            if len(moe) == 1:
                layers = list(rows[-1]["expert_load"])
                depth = self.plt.get_cmap("viridis")
                for n, layer in enumerate(layers):
                    color = depth(n / max(1, len(layers) - 1))
                    for key, style in (("max", "-"), ("min", "--")):
                        ax_load.plot(x, [r["expert_load"].get(layer, {}).get(key, float("nan")) for r in rows],
                                     style, color=color, linewidth=1.2, label=f"layer {layer} {key}")
            else:
                for key, style in (("expert_load_max", "-"), ("expert_load_min", "--")):
                    self._line(ax_load, i, run, rows, key, linestyle=style, linewidth=1.2)
            self._line(ax_aux, i, run, rows, "aux_loss", smooth=True, linewidth=1.5)
        ax_load.axhline(1.0, color="gray", linewidth=0.8)  # every expert at its fair share
        ax_load.set_title("expert load: most (solid) and least (dashed) loaded expert")
        ax_load.set_ylabel("tokens per expert / mean over experts")
        ax_aux.set_title("load-balancing aux loss (summed over MoE layers)")
        ax_aux.set_ylabel("aux loss")
        if len(moe) == 1 and len(ax_load.lines) > 24:  # a deep model: a legend would cover the lines
            ax_load.set_title("expert load: most (solid) and least (dashed) loaded expert, "
                              "first MoE layer dark to last yellow", fontsize=9)
            return self._save(fig, "experts.png", [ax_aux])
        return self._save(fig, "experts.png", [ax_load, ax_aux])

    def ranks(self) -> Path:
        """Each rank's own time in the sampled steps (rank_step_s, trainer/observe/stragglers.py)."""
        fig, (ax,) = self._figure("each rank's own time in a step (compute and reading, no waiting)")
        timed = [run for run in self.runs if any("rank_step_s" in r for r in run.train)]
        for i, run in enumerate(timed):
            rows = [r for r in run.train if "rank_step_s" in r]
            x = [r["tokens"] for r in rows]
            if len(timed) == 1:
                ranks = self.plt.get_cmap("viridis")
                world = len(rows[-1]["rank_step_s"])
                for rank in range(world):
                    ax.plot(x, [r["rank_step_s"][rank] * 1e3 if rank < len(r["rank_step_s"]) else float("nan")
                                for r in rows], marker=".", linewidth=1, color=ranks(rank / max(1, world - 1)),
                            label=f"rank {rank}")
                ax.set_ylabel("ms")
            else:
                ax.plot(x, [slowest_over_median(r["rank_step_s"]) for r in rows], marker=".", linewidth=1,
                        color=self.colors[i % len(self.colors)], label=_short(run.label))
                ax.set_ylabel("slowest rank / the other ranks' median")
        return self._save(fig, "ranks.png", [ax])

    def simple(self, key: str, title: str, ylabel: str, name: str, rows_of, **kw) -> Path:
        fig, (ax,) = self._figure(title)
        for i, group in enumerate(self.groups.values()):
            self._series(ax, i, group, rows_of, key, **kw)
        ax.set_ylabel(ylabel)
        return self._save(fig, name, [ax])


def cmd_report(argv: list[str]) -> None:
    paths, out, baseline = parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (the optional extra dtrain[plot]: is it installed?)
    except ImportError:
        raise UserError("dtrain report draws its figures with matplotlib, which is not installed: "
                        "pip install 'dtrain[plot]'") from None
    run_dirs: list[Path] = []
    for path in paths:
        run_dirs += find_runs(path)
    out, fix = check_figures_folder(out, paths[0])
    names = [d.name if len(paths) == 1 and d != paths[0] else f"{d.parent.name}/{d.name}" for d in run_dirs]
    runs = [load_run(d, n) for d, n in zip(run_dirs, names)]
    run_labels, shared = labels([r.overrides for r in runs], names)
    for run, label in zip(runs, run_labels):
        run.label = label

    console = table_console()
    title = f"report: {', '.join(str(p) for p in paths)}"
    # before anything is printed or written: a --baseline that cannot be tested is one line
    finished = [r.record for r in runs if r.record.get("status") == "ok"]
    analysis, seeds = seed_statistics(finished, identity, f"{title}: seeds (train.seed) per group", baseline)
    console.print(results_table([r.record for r in runs], title))
    if seeds is not None:
        console.print(seeds, highlight=False, soft_wrap=True)
    for r in runs:
        if r.record.get("status") not in ("ok", None) and r.record.get("error"):
            console.print(f"[red]{r.name} {r.record['status']}:[/] {r.record['error']}", highlight=False)
    for r in runs:
        harness = read_harness(r.path)
        if harness is not None:
            console.print(harness_table(harness, f"{r.name}: lm-evaluation-harness"))

    plotted = [r for r in runs if r.train or r.val]
    if not plotted:
        raise UserError(f"no run under {', '.join(map(str, paths))} has logged a step yet; nothing to plot")
    plot = Plotter(plotted, shared, out)
    files = [
        plot.loss(),
        plot.simple("lr", "learning rate", "learning rate", "lr.png", lambda r: r.train, linewidth=1.5),
        plot.simple("tokens_per_s", "training throughput", "tokens / s", "tokens_per_s.png",
                    lambda r: r.train, marker=".", linewidth=1),
    ]
    if any(r.hellaswag for r in plotted):
        files.append(plot.simple("hellaswag_acc_norm", "HellaSwag accuracy (acc_norm)", "acc_norm",
                                 "hellaswag.png", lambda r: r.hellaswag, marker="o", markersize=3))
    if any("expert_load" in r for run in plotted for r in run.train):
        files.append(plot.experts())
    if any("rank_step_s" in r for run in plotted for r in run.train):
        files.append(plot.ranks())
    if analysis is not None:  # written with the figures, as one more of the files
        plot.rendered[REPORT_FILE] = (json.dumps(analysis, indent=2) + "\n").encode()
        files.append(out / REPORT_FILE)
    check_room(out, [len(png) for png in plot.rendered.values()], "the figures", fix)
    with write_errors_as_user_errors(out, fix):
        out.mkdir(parents=True, exist_ok=True)
        mode = new_file_mode()
        for name, png in plot.rendered.items():
            write_atomic(out / name, png, mode=mode)
    console.print("figures: " + "  ".join(str(f) for f in files), highlight=False, soft_wrap=True)


def check_figures_folder(out: Path | None, path: Path) -> tuple[Path, str]:
    """(the folder the figures go to: --out, else the one PATH; the advice for choosing another),
    refused before anything is read when it cannot take them: a file, a read-only or full disk, or
    a checkpoint folder (only a save writes there)."""
    if out is None:
        out, what, fix = path, f"{path} (where the figures go without --out)", "write them elsewhere with --out DIR"
    else:
        what, fix = f"--out {out}", "choose another --out DIR"
    checkpoint = enclosing_checkpoint(out)
    if checkpoint is not None:
        raise UserError(f"{what} is in the checkpoint folder {checkpoint}, where only a save writes; {fix}")
    check_writable_dir(out, what, fix)
    return out, fix
