"""Seeds as a result (trainer/observe/stats.py): runs that differ only in train.seed form a group; the
sweep's table, `dtrain report` and its report.json give per group and figure n, mean, sd and a 95%
CI, and between groups the difference, its Welch 95% CI and p-value. The statistics are checked on
fixed numbers against values computed another way, and a 2 x 3 sweep of the tiny model against a
hand computation from its points' metrics.jsonl."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from helpers.dtrain import read_metrics, run_dtrain, sweep_args

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
def fake_point(sweep_dir: Path, num: int, overrides: list[str], val: float) -> None:
    point = sweep_dir / str(num)
    (point / ".hydra").mkdir(parents=True)
    (point / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    records = [{"step": 1, "tokens": 256, "loss": val + 1, "lr": 1e-3, "tokens_per_s": 100.0},
               {"step": 1, "tokens": 256, "val_loss": val},
               {"step": 1, "tokens": 256, "summary": {"best_val_loss": val, "train_tokens_per_s": 100.0 + num}}]
    (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_baseline_of_single_runs_is_one_error_line_and_writes_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    sweep_dir = tmp_path / "sweep"
    for num, lr in enumerate(("1e-3", "3e-3")):
        fake_point(sweep_dir, num, [f"optim.lr={lr}"], 4.0 + num)
    before = sorted(p.relative_to(sweep_dir) for p in sweep_dir.rglob("*"))
    proc = run_dtrain(["report", str(sweep_dir), "--baseline", "optim.lr=1e-3"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --baseline asks for p-values, which need two runs or more per group, and optim.lr=1e-3 | "
        "optim.lr=3e-3 has one: add seeds (sweep.seeds=3, or train.seed=0,1,2) or leave out --baseline"]
    assert sorted(p.relative_to(sweep_dir) for p in sweep_dir.rglob("*")) == before

    proc = run_dtrain(["report", str(sweep_dir)], check=True)  # without it: groups of one, nothing tested
    report = json.loads((sweep_dir / "report.json").read_text())
    assert report["comparisons"] == []
    assert [(g["overrides"], g["n"]) for g in report["groups"]] == [(["optim.lr=1e-3"], 1), (["optim.lr=3e-3"], 1)]
    assert report["groups"][1]["figures"]["best_val_loss"] == {"mean": 5.0, "sd": None, "ci95": None}
    assert "seeds (train.seed) per group" not in proc.stdout  # no group of seeds: no seeds table


# --- a 2 x 3 sweep of the tiny model --------------------------------------------------------------
def by_hand(point_dirs: list[Path]) -> dict[str, list[float]]:
    """The figures of each point, read straight from its metrics.jsonl."""
    out: dict[str, list[float]] = {"final_val_loss": [], "best_val_loss": [], "final_val_bpb": [],
                                   "train_tokens_per_s": [], "target_train_s": [], "target_tokens": []}
    for point in point_dirs:
        records = read_metrics(point)
        end = [r for r in records if "summary" in r][-1]
        out["final_val_loss"].append([r["val_loss"] for r in records if "val_loss" in r][-1])
        out["final_val_bpb"].append([r["val_bpb"] for r in records if "val_bpb" in r][-1])
        out["best_val_loss"].append(end["summary"]["best_val_loss"])
        out["train_tokens_per_s"].append(end["summary"]["train_tokens_per_s"])
        out["target_train_s"].append(end["target"]["train_s"])
        out["target_tokens"].append(end["target"]["tokens"])
    return out


@pytest.mark.slow
def test_two_recipes_three_seeds_sweep_and_report(data_dir, tmp_path):
    pytest.importorskip("matplotlib")
    sweep_dir = tmp_path / "sweep"
    # the target is met at the first evaluation (step 3); the points go on to step 6
    proc = run_dtrain(sweep_args(data_dir, "optim.lr=1e-3,3e-3", "sweep.seeds=3", "checkpoint.interval=0",
                                 "train.target_val_loss=10.75", "train.continue_after_target=true",
                                 f"hydra.sweep.dir={sweep_dir}"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    points = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    seeds = [[o for o in p["overrides"] if o.startswith(("optim.lr=", "train.seed="))] for p in points]
    assert seeds == [[lr, f"train.seed={s}"] for lr in ("optim.lr=0.001", "optim.lr=0.003") for s in range(3)]
    groups = [sweep_dir / str(n) for n in range(6)]
    a, b = by_hand(groups[:3]), by_hand(groups[3:])
    assert all(read_metrics(p)[-1]["target"]["step"] == 3 for p in groups)

    report_proc = run_dtrain(["report", str(sweep_dir)], check=True)
    report = json.loads((sweep_dir / "report.json").read_text())
    assert set(report) == {"groups", "comparisons"}
    got_a, got_b = report["groups"]
    assert got_a["n"] == got_b["n"] == 3
    assert "optim.lr=0.001" in got_a["overrides"] and not any(o.startswith("train.seed") for o in got_a["overrides"])
    for figure in a:
        for got, values in ((got_a, a[figure]), (got_b, b[figure])):
            mean, sd = statistics.fmean(values), statistics.stdev(values)
            half = T_975_2DF * sd / math.sqrt(3)
            assert set(got["figures"][figure]) == {"mean", "sd", "ci95"}
            assert got["figures"][figure]["mean"] == pytest.approx(mean, rel=1e-12)
            assert got["figures"][figure]["sd"] == pytest.approx(sd, rel=1e-9, abs=1e-12)
            assert got["figures"][figure]["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-9)
    comparisons = {c["figure"]: c for c in report["comparisons"]}
    assert set(comparisons) == set(a)
    for figure, c in comparisons.items():
        assert (c["a"], c["b"]) == (got_a["overrides"], got_b["overrides"])
        assert c["diff"] == pytest.approx(statistics.fmean(b[figure]) - statistics.fmean(a[figure]), rel=1e-12)
        if statistics.stdev(a[figure]) + statistics.stdev(b[figure]) == 0:  # tokens to target: the same step
            assert c["p_value"] is None and c["ci95"] == [c["diff"], c["diff"]]
            continue
        test = scipy_stats.ttest_ind(b[figure], a[figure], equal_var=False)
        assert c["p_value"] == pytest.approx(test.pvalue, rel=1e-9)
        assert c["ci95"] == pytest.approx(list(test.confidence_interval(0.95)), rel=1e-9)

    # the sweep's own table and the report's show the same figures
    val = comparisons["final_val_loss"]
    for out in (proc.stdout, report_proc.stdout):
        for got in (got_a, got_b):
            s = got["figures"]["final_val_loss"]
            assert f"{s['mean']:.4f}" in out and f"[{s['ci95'][0]:.4f}, {s['ci95'][1]:.4f}]" in out
        assert f"{val['diff']:+.4f}" in out and f"{val['p_value']:.3g}" in out
    assert (sweep_dir / "loss.png").stat().st_size > 0

    # against a named baseline: the other way round
    run_dtrain(["report", str(sweep_dir), "--baseline", "optim.lr=0.003"], check=True)
    flipped = {c["figure"]: c for c in json.loads((sweep_dir / "report.json").read_text())["comparisons"]}
    assert flipped["final_val_loss"]["a"] == got_b["overrides"]
    assert flipped["final_val_loss"]["diff"] == pytest.approx(-val["diff"], rel=1e-12)
    assert flipped["final_val_loss"]["p_value"] == pytest.approx(val["p_value"], rel=1e-9)


def test_a_baseline_naming_a_group_exactly_wins_over_groups_that_add_to_it():
    runs = [{"overrides": ["experiment=cpu", f"train.seed={s}"]} for s in range(2)]
    runs += [{"overrides": ["experiment=cpu", "optim.schedule=wsd", f"train.seed={s}"]} for s in range(2)]
    runs += [{"overrides": ["experiment=fast", f"train.seed={s}"]} for s in range(2)]
    groups = group_runs(runs, lambda overrides: overrides)
    assert find_group(groups, "experiment=cpu").overrides == ["experiment=cpu"]
    assert find_group(groups, "optim.schedule=wsd").overrides == ["experiment=cpu", "optim.schedule=wsd"]
    with pytest.raises(UserError, match="matches no group"):
        find_group(groups, "experiment=other")
