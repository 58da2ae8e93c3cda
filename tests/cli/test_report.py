"""`dtrain report`: PNG figures from a real short run, sweep overlays, the table, and the
message when matplotlib is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def run_dir(data_dir, module_tmp) -> Path:
    """One real short run (val loss every 5 steps) shared by this module's tests."""
    run = module_tmp.mktemp("report") / "run"
    run_dtrain(tiny_args(data_dir, run, "train.val_interval=5"), check=True)
    return run


def copy_run(src: Path, dst: Path, overrides: list[str]) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    (dst / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return dst


@pytest.mark.slow
def test_report_of_a_run_writes_valid_pngs_of_the_expected_size(run_dir, tmp_path):
    out = tmp_path / "figures"
    proc = run_dtrain(["report", str(run_dir), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sizes = {p.name: png_size(p) for p in out.glob("*.png")}
    assert sizes == {"loss.png": (1400, 550), "lr.png": (1000, 550), "tokens_per_s.png": (1000, 550)}
    import matplotlib.image

    image = matplotlib.image.imread(out / "loss.png")
    assert image.shape[:2] == (550, 1400)
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    assert "best val" in proc.stdout and "ok" in proc.stdout


def test_report_defaults_to_the_run_dir_and_plots_hellaswag_when_present(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path / "run", ["model=tiny"])
    with (run / "metrics.jsonl").open("a") as f:
        for step, acc in ((10, 0.2512), (20, 0.2604)):
            f.write(json.dumps({"step": step, "tokens": step * 256, "hellaswag_acc_norm": acc,
                                "hellaswag_acc": acc - 0.01, "hellaswag_n": 16}) + "\n")
    proc = run_dtrain(["report", str(run)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png_size(run / "hellaswag.png") == (1000, 550)
    assert {"loss.png", "lr.png", "tokens_per_s.png"} <= {p.name for p in run.glob("*.png")}
    assert "0.2604" in proc.stdout  # the last HellaSwag acc_norm in the table


def test_report_of_a_sweep_dir_overlays_its_points(run_dir, tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    copy_run(run_dir, sweep / "0", ["model=tiny", "optim.lr=0.001"])
    copy_run(run_dir, sweep / "1", ["model=tiny", "optim.lr=0.003"])
    proc = run_dtrain(["report", str(sweep)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png_size(sweep / "loss.png") == (1400, 550)
    table = proc.stdout
    assert "optim.lr=0.001" in table and "optim.lr=0.003" in table  # one row per point, by label
    assert "model=tiny" in table  # the shared override, once, under the table


def test_report_without_matplotlib_says_how_to_install_it(run_dir, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from trainer.cli import main; "
            f"main(['report', {str(run_dir)!r}, '--out', {str(tmp_path)!r}])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dtrain_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "pip install 'dtrain[plot]'" in proc.stderr
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("args, message", [
    ([], "give at least one run"),
    (["/nonexistent/run"], "does not exist"),
    (["A", "B"], "choose where the figures go with --out"),
    (["--bogus"], "unknown flag"),
])
def test_report_usage_errors(args, message):
    proc = run_dtrain(["report", *args])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_report_of_a_folder_without_runs_is_an_error(tmp_path):
    proc = run_dtrain(["report", str(tmp_path)])
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr, proc.stderr


def test_report_shows_hellaswag_from_dtrain_eval_s_result_file(run_dir, tmp_path):
    """A run scored afterwards by `dtrain eval` (eval_hellaswag.json beside it): the table shows it."""
    run = copy_run(run_dir, tmp_path / "run", ["model=tiny"])
    (run / "eval_hellaswag.json").write_text(json.dumps({"hellaswag_acc_norm": 0.3125, "hellaswag_n": 32}))
    proc = run_dtrain(["report", str(run), "--out", str(tmp_path / "figures")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0.3125" in proc.stdout


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
