"""Seeds as a result (trainer/observe/stats.py): runs that differ only in train.seed form a group; the
sweep's table, `dtrain report` and its report.json give per group and figure n, mean, sd and a 95%
CI, and between groups the difference, its Welch 95% CI and p-value. The statistics are checked on
fixed numbers against values computed another way (a 2 x 3 sweep of the tiny model against a hand
computation from its points' metrics.jsonl: tests/system/test_sweep_seeds.py; `dtrain report
--baseline` on single runs: tests/cli/test_report.py)."""

from __future__ import annotations

import math
import statistics
import sys

import pytest

from trainer.config.command_line import expand_seeds
from trainer.config.keys import identity
from trainer.errors import UserError
from trainer.observe.stats import INSTALL_HINT, analyse, find_group, group_runs, seed_statistics, summarize, welch

scipy_stats = pytest.importorskip("scipy.stats")

T_975_2DF = 4.302652729749462  # Student's t, 97.5th percentile, 2 degrees of freedom (tables: 4.303)


# --- the statistics on fixed numbers ------------------------------------------------------------
def test_summary_of_three_values():
    s = summarize([1.0, 2.0, 4.0])
    mean, sd = 7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    half = T_975_2DF * sd / math.sqrt(3)
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(mean, rel=1e-15) and s["sd"] == pytest.approx(sd, rel=1e-15)
    assert s["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-12)


def test_one_value_has_no_spread_and_no_test():
    assert summarize([3.5]) == {"n": 1, "mean": 3.5, "sd": None, "ci95": None}
    with pytest.raises(ValueError):
        welch([1.0], [1.0, 2.0])


def test_welch_difference_interval_and_p_value():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    got = welch(a, b)
    # by hand: Welch-Satterthwaite degrees of freedom, then scipy's own test and interval
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 5
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 4)
    assert df == pytest.approx(5.520787746170677, rel=1e-12)
    reference = scipy_stats.ttest_ind(b, a, equal_var=False)
    assert got["diff"] == 6.0 - 2.5
    assert got["p_value"] == pytest.approx(reference.pvalue, rel=1e-12)
    assert got["p_value"] == pytest.approx(0.06913359319239237, rel=1e-9)
    interval = reference.confidence_interval(0.95)
    assert got["ci95"] == pytest.approx([interval.low, interval.high], rel=1e-12)


def test_no_spread_in_either_group_gives_no_p_value():
    assert welch([2.0, 2.0], [3.0, 3.0]) == {"diff": 1.0, "ci95": [1.0, 1.0], "p_value": None}


def test_groups_leave_out_the_seed_and_the_sweep_settings():
    records = [{"overrides": ["optim=adamw", f"train.seed={s}", "sweep.fail_fast=true"], "best_val_loss": v}
               for s, v in ((0, 4.0), (1, 4.2), (2, 4.1))]
    records += [{"overrides": ["optim=muon", f"train.seed={s}"], "best_val_loss": v} for s, v in ((0, 3.9), (1, 3.8))]
    records.append({"overrides": ["optim=sgd"], "best_val_loss": 5.0})
    groups = group_runs(records, identity)
    assert [(g.overrides, g.n) for g in groups] == [(["optim=adamw"], 3), (["optim=muon"], 2), (["optim=sgd"], 1)]
    out = analyse(groups)
    assert [g["figures"]["best_val_loss"]["sd"] is None for g in out["groups"]] == [False, False, True]
    # every group of two runs or more against the first; the group of one is not tested
    (c,) = out["comparisons"]
    assert (c["a"], c["b"], c["figure"]) == (["optim=adamw"], ["optim=muon"], "best_val_loss")
    assert c["diff"] == pytest.approx(3.85 - 4.1)
    with pytest.raises(UserError, match="optim=sgd has one"):
        seed_statistics(records, identity, "t", baseline="optim=adamw")
    with pytest.raises(UserError, match="matches no group"):
        seed_statistics(records, identity, "t", baseline="optim=lion")


def test_a_figure_some_seeds_lack_is_left_out_of_the_group():
    records = [{"overrides": [f"train.seed={s}"], "best_val_loss": 4.0 + s, "target_train_s": t}
               for s, t in ((0, 3.0), (1, None), (2, 4.0))]
    (group,) = analyse(group_runs(records, identity))["groups"]
    assert set(group["figures"]) == {"best_val_loss"}  # a mean of the two that met the target would flatter


def test_without_scipy_the_table_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # an import of scipy now fails, as when it is not installed
    records = [{"overrides": [f"train.seed={s}"], "best_val_loss": 4.0 + s} for s in range(3)]
    assert seed_statistics(records, identity, "t") == (None, INSTALL_HINT)
    assert "pip install 'dtrain[stats]'" in INSTALL_HINT
    with pytest.raises(UserError, match=r"dtrain\[stats\]"):
        seed_statistics(records, identity, "t", baseline="train.seed=0")


def test_seeds_shorthand_is_the_seed_axis():
    assert expand_seeds(["-m", "optim=adamw,muon", "sweep.seeds=3", "world=1"], multirun=True) == [
        "-m", "optim=adamw,muon", "train.seed=0,1,2", "world=1"]
    assert expand_seeds(["optim=adamw"], multirun=False) == ["optim=adamw"]
    for args, multirun, message in ((["sweep.seeds=3"], False, "add -m"),
                                    (["sweep.seeds=2", "train.seed=5"], True, "both set the seed"),
                                    (["sweep.seeds=0"], True, "at least 1"),
                                    (["sweep.seeds=x"], True, "at least 1")):
        with pytest.raises(UserError, match=message):
            expand_seeds(args, multirun)


# --- dtrain report on recorded runs (no training) -----------------------------------------------


# --- a 2 x 3 sweep of the tiny model --------------------------------------------------------------


def test_a_baseline_naming_a_group_exactly_wins_over_groups_that_add_to_it():
    runs = [{"overrides": ["experiment=cpu", f"train.seed={s}"]} for s in range(2)]
    runs += [{"overrides": ["experiment=cpu", "optim.schedule=wsd", f"train.seed={s}"]} for s in range(2)]
    runs += [{"overrides": ["experiment=fast", f"train.seed={s}"]} for s in range(2)]
    groups = group_runs(runs, lambda overrides: overrides)
    assert find_group(groups, "experiment=cpu").overrides == ["experiment=cpu"]
    assert find_group(groups, "optim.schedule=wsd").overrides == ["experiment=cpu", "optim.schedule=wsd"]
    with pytest.raises(UserError, match="matches no group"):
        find_group(groups, "experiment=other")
