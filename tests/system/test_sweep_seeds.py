"""A 2 x 3 sweep of the tiny model (two recipes, three seeds each) and `dtrain report` on it: the
groups' n, mean, sd and 95% CI and the comparison's Welch CI and p-value against a hand computation
from the points' metrics.jsonl (tests/unit/test_seeds_stats.py checks the statistics on fixed numbers)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from helpers.dtrain import read_metrics, run_dtrain, tiny_args

scipy_stats = pytest.importorskip("scipy.stats")

T_975_2DF = 4.302652729749462  # Student's t, 97.5th percentile, 2 degrees of freedom (tables: 4.303)


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
    proc = run_dtrain(tiny_args(data_dir, sweep_dir, "optim.lr=1e-3,3e-3", "sweep.seeds=3", "checkpoint.interval=0",
                                 "train.target_val_loss=10.75", "train.continue_after_target=true", sweep=True))
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
