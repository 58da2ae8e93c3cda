"""train.on_nonfinite=stop|skip|rollback: real runs with non-finite losses (DTRAIN_INJECT_NONFINITE
and optim.lr=1e6), the Checkpointer's refusal, and eval/sample/export refusing NaN weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.checkpoints import assert_finite_checkpoints, steps_of, strict_metrics
from helpers.dtrain import inject, run_dtrain, tiny_args
from helpers.errors import error_lines

from trainer.checkpoint import manager
from trainer.checkpoint.layout import list_checkpoints
from trainer.cli import main
from trainer.config.batch import batch_plan
from trainer.config.schema import from_dict
from trainer.errors import NonFiniteError
from trainer.fit.run import TrainState
from trainer.model.gpt import build_model
from trainer.observe.metrics import MetricsLogger
from trainer.optim.build import build_optimizer
from trainer.parallel import make_strategy
from trainer.process.runtime import Runtime


@pytest.fixture(scope="module")
def stopped(data_dir, module_tmp):
    """on_nonfinite=stop (the default) with step 5's loss made NaN; checkpoints every 2 steps."""
    run_dir = module_tmp.mktemp("stop") / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=8", "checkpoint.interval=2",
                                "train.log_interval=2"), env=inject(5))
    return run_dir, proc


def test_stop_is_one_line_exit_1_and_saves_nothing_after_the_bad_step(stopped):
    run_dir, proc = stopped
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    newest = run_dir / "checkpoints" / "step_000004"
    assert "non-finite loss (nan" in lines[0] and "at step 5" in lines[0] and str(newest) in lines[0]
    assert steps_of(run_dir) == [2, 4]
    records = strict_metrics(run_dir)
    bad = [r for r in records if r.get("step") == 5]
    assert len(bad) == 1 and bad[0]["loss"] is None and bad[0]["grad_norm"] is None
    assert max(r["step"] for r in records) == 5


@pytest.mark.slow
def test_stop_under_ddp_is_one_clean_line(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=6",
                                "checkpoint.interval=2"), env=inject(3))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == error_lines(proc), proc.stderr  # nothing but the line
    assert len(error_lines(proc)) == 1 and "at step 3" in proc.stderr and "step_000002" in proc.stderr
    assert steps_of(run_dir) == [2]


@pytest.mark.slow
def test_skip_goes_on_and_counts(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=8", "train.log_interval=4",
                                "checkpoint.interval=4", "train.on_nonfinite=skip"), env=inject(3, 4, 6))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = strict_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 3, 4, 6, 8]
    assert {r["step"]: r["skipped"] for r in train} == {1: 0, 3: 1, 4: 1, 6: 1, 8: 0}
    assert all(r["loss"] is None for r in train if r["step"] in (3, 4, 6))
    summary = records[-1]["summary"]
    assert summary["skipped"] == 3 and summary["steps"] == 8
    assert summary["final_loss"] == pytest.approx(train[-1]["loss"])
    assert train[-1]["loss"] > 0 and steps_of(run_dir) == [4, 8]
    assert_finite_checkpoints(run_dir)


@pytest.mark.slow
def test_skip_stops_after_max_nonfinite_in_a_row(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=8", "checkpoint.interval=2",
                                "train.on_nonfinite=skip", "train.max_nonfinite=2"), env=inject(3, 5, 6))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "at step 6, 2 in a row" in lines[0], proc.stderr
    assert "step_000004" in lines[0] and steps_of(run_dir) == [2, 4]
    strict_metrics(run_dir)


def test_rollback_under_ddp_moves_the_data_on(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=10",
                                "checkpoint.interval=2", "checkpoint.keep=10", "train.on_nonfinite=rollback"),
                      env=inject(5, 8))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = strict_metrics(run_dir)
    rollbacks = [r["rollback"] for r in records if "rollback" in r]
    assert [(r["from_step"], r["count"]) for r in rollbacks] == [(5, 1), (8, 2)]
    assert rollbacks[0]["checkpoint"].endswith("step_000004") and rollbacks[1]["checkpoint"].endswith("step_000006")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))  # the failed continuations were dropped
    assert all(r["loss"] is not None and r["loss"] > 0 for r in train)
    assert records[-1]["summary"]["rollbacks"] == 2
    assert steps_of(run_dir) == [2, 4, 6, 8, 10]
    # each rollback is one notice on stderr, kept in the run's dtrain.log too (rank 0 is a worker here)
    assert proc.stderr.count("rolled back to") == 2, proc.stderr
    assert (run_dir / "dtrain.log").read_text().count("rolled back to") == 2
    assert_finite_checkpoints(run_dir)

    def offset(step: int) -> int:
        state = json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
        loader = state["loaders"][0]
        assert loader["epoch"] == 0 and loader["shard_pos"] == 0
        return loader["token_offset"]

    per_step = offset(2) // 2
    # the batches of the failed step 5 and of the abandoned steps 7-8 are not read again:
    # 10 steps trained on 13 steps' worth of data
    assert offset(10) == per_step * 13


@pytest.mark.slow
def test_huge_lr_never_writes_nor_rotates_away_the_finite_checkpoint(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "optim.lr=1e6", "optim.warmup_steps=1", "checkpoint.interval=1",
                                "checkpoint.keep=2", "train.max_steps=30"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and "non-finite" in lines[0], proc.stderr
    kept = list_checkpoints(run_dir / "checkpoints")
    assert 1 <= len(kept) <= 2 and str(kept[-1]) in lines[0]
    assert_finite_checkpoints(run_dir)
    strict_metrics(run_dir)


def _nan_checkpoint(run_dir: Path, monkeypatch) -> None:
    """A newest checkpoint with NaN weights in a real run dir, as a run from before the guard wrote
    it: the product's own save path with its finiteness check switched off."""
    cfg = from_dict(json.loads((run_dir / "resolved_config.json").read_text()))
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    strategy = make_strategy(cfg.parallel, cfg.train, rt)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, strategy)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "shard_pos": 0, "token_offset": 0})
    run = SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=loader,
                          state=TrainState(step=99, tokens=0), plan=batch_plan(cfg, 1))
    checkpointer = manager.Checkpointer(cfg, rt, run_dir)
    with pytest.raises(NonFiniteError, match="refusing to save checkpoint step_000099: 1 tensor with NaN"):
        checkpointer.save(run)  # the guard
    assert steps_of(run_dir)[-1] == 4
    monkeypatch.setattr(manager, "nonfinite_tensors", lambda state: [])
    checkpointer.save(run)
    checkpointer.close()
    assert steps_of(run_dir)[-1] == 99


@pytest.mark.parametrize("argv", [["export", "{run}", "--out", "{run}/hf"], ["sample", "{run}", "--tokens", "4"],
                                  ["eval", "{run}", "eval.hellaswag.path={run}/hs.jsonl"]])
def test_commands_refuse_a_nonfinite_checkpoint(stopped, argv, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped[0], run_dir)
    _nan_checkpoint(run_dir, monkeypatch)
    example = {"ctx": "The king", "endings": ["spoke.", "ran.", "sat.", "slept."], "label": 0}
    (run_dir / "hs.jsonl").write_text(json.dumps(example) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(run=run_dir) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("error:") == 1 and "non-finite weights" in err and "step_000099" in err, err
    assert not (run_dir / "hf").exists()


@pytest.mark.parametrize("override, message", [
    ("train.on_nonfinite=ignore", "train.on_nonfinite='ignore' is unknown; choose one of stop, skip, rollback"),
    ("train.max_nonfinite=0", "train.max_nonfinite=0 must be at least 1"),
])
def test_bad_settings_are_one_line(data_dir, tmp_path, override, message):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", override))
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_metrics_write_null_for_nonfinite_numbers(tmp_path):
    metrics = MetricsLogger(tmp_path, True)
    metrics.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "summary": {"final_loss": float("-inf")}})
    metrics.rewind(0)
    metrics.log({"step": 1, "loss": float("nan")})
    metrics.close()
    assert [{k: v for k, v in r.items() if k != "time"} for r in strict_metrics(tmp_path)] == [
        {"step": 1, "loss": None}]
