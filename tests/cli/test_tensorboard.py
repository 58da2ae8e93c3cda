"""logger=tensorboard: event files beside metrics.jsonl with the same scalars, resumes that drop
the events past the resumed step, and a one-line error when tensorboard is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args

pytest.importorskip("tensorboard")


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_logger_writes_the_metrics_as_scalars(data_dir, tmp_path):
    run = tmp_path / "run"
    run_dtrain(tiny_args(data_dir, run, "logger=tensorboard", "train.max_steps=8", "train.val_interval=4"),
               check=True)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    tb = scalars(run / "tensorboard")
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tokens", "val_loss"} <= set(tb)
    records = read_metrics(run)
    train = {r["step"]: r for r in records if "loss" in r}
    assert sorted(tb["loss"]) == sorted(train) == list(range(1, 9))
    for step, record in train.items():
        assert tb["loss"][step] == pytest.approx(record["loss"], rel=1e-6)
        assert tb["lr"][step] == pytest.approx(record["lr"], rel=1e-6)
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert tb["val_loss"] == pytest.approx(vals, rel=1e-6)
    assert "summary" not in tb  # the end-of-run summary record is not a scalar


def test_a_resumed_logger_drops_events_past_the_resumed_step(tmp_path):
    from trainer.observe.metrics import MetricsLogger
    from trainer.observe.trackers import TensorBoardSink

    first = MetricsLogger(tmp_path, enabled=True, sinks=[TensorBoardSink(tmp_path)])
    for step in range(1, 7):
        first.log({"step": step, "tokens": step * 10, "loss": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, enabled=True, resume_step=3, sinks=[TensorBoardSink(tmp_path, 3)])
    for step in (4, 5):
        resumed.log({"step": step, "tokens": step * 10, "loss": 100.0 + step})
    resumed.close()
    assert scalars(tmp_path / "tensorboard")["loss"] == {1: 1.0, 2: 2.0, 3: 3.0, 4: 104.0, 5: 105.0}
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0, 104.0, 105.0]


def test_tensorboard_missing_is_one_line_with_the_install_command(data_dir, tmp_path):
    run = tmp_path / "run"
    code = ("import sys; sys.modules['tensorboard'] = None; sys.argv = ['dtrain'] + sys.argv[1:]; "
            "from trainer.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, *tiny_args(data_dir, run, "logger=tensorboard")],
                          cwd=REPO, capture_output=True, text=True, env=dtrain_env(), timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'dtrain[tensorboard]'" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not (run / "metrics.jsonl").exists()
