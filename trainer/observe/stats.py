"""Seeds as a result: the points of a sweep (or the runs of a report) that differ only in train.seed
form a group; per group and figure, n, mean, standard deviation and a 95% confidence interval
(Student's t); between two groups, the difference of means with its 95% interval and Welch's
t-test p-value (unequal variances, Welch-Satterthwaite degrees of freedom).

The distributions are scipy's (`pip install 'dtrain[stats]'`), imported only where a statistic is
computed: without scipy the tables say how to install it in one line. No torch here."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from trainer.errors import UserError

SEED_KEY = "train.seed"
# The figures compared across seeds: record key -> (the column's name, its format, lower is better).
FIGURES = {
    "final_val_loss": ("final val loss", ".4f"),
    "best_val_loss": ("best val loss", ".4f"),
    "final_val_bpb": ("final val bpb", ".4f"),  # bits per byte: comparable across tokenizers
    "train_tokens_per_s": ("train tokens/s", ",.0f"),
    "target_train_s": ("train s to target", ".2f"),
    "target_tokens": ("tokens to target", ",.0f"),
}
INSTALL_HINT = "seed statistics (sd, 95% CI, Welch's t-test) need scipy: pip install 'dtrain[stats]'"


def scipy_stats():
    """scipy.stats, or None when the optional extra dtrain[stats] is not installed."""
    try:
        from scipy import stats  # the optional extra dtrain[stats]: only where statistics are computed
    except ImportError:
        return None
    return stats


def _require_scipy():
    stats = scipy_stats()
    if stats is None:
        raise UserError(INSTALL_HINT)
    return stats


def summarize(values: list[float]) -> dict[str, Any]:
    """n, mean, sample standard deviation and the mean's 95% confidence interval (t with n-1
    degrees of freedom). One value has no spread: sd and ci95 are None."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci95": None}
    sd = statistics.stdev(values)
    half = _require_scipy().t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def welch(a: list[float], b: list[float]) -> dict[str, Any]:
    """mean(b) - mean(a), its 95% confidence interval with Welch-Satterthwaite degrees of freedom,
    and Welch's two-sided t-test p-value (scipy.stats.ttest_ind, equal_var=False). Both samples
    need two values or more; with no spread in either the interval is the difference itself and the
    p-value None (0 when the means differ would claim certainty no sample gives)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's t-test needs at least two values per group")
    stats = _require_scipy()
    diff = statistics.fmean(b) - statistics.fmean(a)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "ci95": [diff, diff], "p_value": None}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.975, df) * se
    p_value = float(stats.ttest_ind(b, a, equal_var=False).pvalue)
    return {"diff": diff, "ci95": [diff - half, diff + half], "p_value": p_value}


@dataclass
class Group:
    """Runs whose overrides are the same but for train.seed."""

    overrides: list[str]  # what defines the group (train.seed left out)
    records: list[dict[str, Any]]

    @property
    def n(self) -> int:
        return len(self.records)

    def values(self, figure: str) -> list[float] | None:
        """The figure of every run, or None when a run lacks it (a target one seed missed): a mean
        over the seeds that have it would hide the others."""
        found = [r.get(figure) for r in self.records]
        if not found or any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in found):
            return None
        return [float(v) for v in found]


def without_seed(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.partition("=")[0].lstrip("+~") != SEED_KEY]


def group_runs(records: list[dict[str, Any]], identity) -> list[Group]:
    """Records (each with `overrides`) grouped by their identity overrides less train.seed, in the
    order of each group's first run. `identity` picks the overrides that decide what a run trains."""
    groups: dict[tuple[str, ...], Group] = {}
    for record in records:
        key = without_seed(identity(record.get("overrides") or []))
        groups.setdefault(tuple(key), Group(key, [])).records.append(record)
    return list(groups.values())


def find_group(groups: list[Group], baseline: str) -> Group:
    """The group a `--baseline` names: its overrides, space-separated, in any order (those shared
    by every group may be left out). A group whose overrides are exactly those wins over the groups
    that add to them (`experiment=a` is experiment=a's group, not also experiment=a's with a schedule)."""
    wanted = set(baseline.split())
    found = [g for g in groups if wanted <= set(g.overrides)]
    shared = set.intersection(*(set(g.overrides) for g in groups)) if groups else set()
    exact = [g for g in found if set(g.overrides) - shared <= wanted]
    found = exact if len(exact) == 1 else found
    if len(found) != 1:
        names = "; ".join(" ".join(g.overrides) or "(no overrides)" for g in groups)
        why = "matches no group" if not found else f"matches {len(found)} groups"
        raise UserError(f"--baseline {baseline!r} {why}; name one group by its overrides: {names}")
    return found[0]


def analyse(groups: list[Group], baseline: Group | None = None) -> dict[str, Any]:
    """report.json's content: `groups` (overrides, n, figures: mean, sd, ci95) and `comparisons`
    (every group against `baseline`, else against the first group of two runs or more: a, b,
    figure, diff = mean(b) - mean(a), ci95, p_value). A named baseline, or a group compared with
    it, of one run is refused: it has no spread to test."""
    if baseline is not None:
        small = [g for g in groups if g.n < 2]
        if small:
            names = " | ".join(" ".join(g.overrides) or "(no overrides)" for g in small)
            raise UserError(f"--baseline asks for p-values, which need two runs or more per group, and {names} "
                            "has one: add seeds (sweep.seeds=3, or train.seed=0,1,2) or leave out --baseline")
    out_groups = []
    for g in groups:
        figures = {}
        for figure in FIGURES:
            values = g.values(figure)
            if values is not None:
                s = summarize(values)
                figures[figure] = {"mean": s["mean"], "sd": s["sd"], "ci95": s["ci95"]}
        out_groups.append({"overrides": g.overrides, "n": g.n, "figures": figures})
    comparisons = []
    reference = baseline or next((g for g in groups if g.n >= 2), None)
    for g in groups:
        if reference is None or g is reference or g.n < 2:
            continue
        for figure in FIGURES:
            a, b = reference.values(figure), g.values(figure)
            if a is not None and b is not None:
                comparisons.append({"a": reference.overrides, "b": g.overrides, "figure": figure, **welch(a, b)})
    return {"groups": out_groups, "comparisons": comparisons}


def _label(overrides: list[str], shared: set[str]) -> str:
    return " ".join(o for o in overrides if o not in shared) or "-"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def groups_table(analysis: dict[str, Any], title: str) -> Table:
    """One row per group and figure (n, mean, sd, 95% CI), then one per comparison (difference,
    its 95% CI, Welch's p)."""
    all_overrides = [g["overrides"] for g in analysis["groups"]]
    shared = set.intersection(*map(set, all_overrides)) if len(all_overrides) > 1 else set()
    table = Table(title=title, caption="95% CI: Student's t (groups), Welch (differences, b - a)",
                  caption_justify="left")
    for name, justify in (("group", "left"), ("figure", "left"), ("n", "right"), ("mean", "right"),
                          ("sd", "right"), ("95% CI", "right"), ("p (Welch)", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    for g in analysis["groups"]:
        first = True
        for figure, s in g["figures"].items():
            name, spec = FIGURES[figure]
            ci = "-" if s["ci95"] is None else f"[{_num(s['ci95'][0], spec)}, {_num(s['ci95'][1], spec)}]"
            table.add_row(_label(g["overrides"], shared) if first else "", name, str(g["n"]) if first else "",
                          _num(s["mean"], spec), _num(s["sd"], spec), ci, "")
            first = False
    for c in analysis["comparisons"]:
        name, spec = FIGURES[c["figure"]]
        table.add_row(f"{_label(c['b'], shared)} - {_label(c['a'], shared)}", name, "",
                      _num(c["diff"], "+" + spec), "", f"[{_num(c['ci95'][0], spec)}, {_num(c['ci95'][1], spec)}]",
                      _num(c["p_value"], ".3g"))
    return table


def seed_statistics(records: list[dict[str, Any]], identity, title: str,
                    baseline: str | None = None) -> tuple[dict[str, Any] | None, Table | str | None]:
    """(report.json's content, what to print: the groups' table, or None when no group has two
    runs and no baseline is asked for) for runs' records. Without scipy, groups of two runs or
    more are not analysed: None and the one line that says how to install it."""
    groups = group_runs(records, identity)
    seeded = any(g.n >= 2 for g in groups)
    if scipy_stats() is None and (seeded or baseline is not None):
        if baseline is not None:
            raise UserError(f"--baseline asks for p-values; {INSTALL_HINT}")
        return None, INSTALL_HINT
    analysis = analyse(groups, find_group(groups, baseline) if baseline is not None else None)
    return analysis, groups_table(analysis, title) if seeded or baseline is not None else None
