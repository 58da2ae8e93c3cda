"""One run per directory: a live run's directory is locked, a finished run is not run again, a
crashed run is continued by the same command, and another run's outputs are never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers.checkpoints import crashed_copy, same_weights, snapshot
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args
from helpers.processes import paced, wait_for_steps
from helpers.runs import CKPT_ARGS
from omegaconf import OmegaConf

from trainer.config.compose import compose
from trainer.config.keys import OPERATIONAL, TRAJECTORY, _matches, key_kind
from trainer.io import dotted_keys


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:") and sum(x.startswith("error:") for x in lines) == 1, lines
    return lines[-1]


def start(args) -> subprocess.Popen:
    """A run in the background, paced (helpers.processes.PACE_S) for the test to interrupt."""
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=paced(dtrain_env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_second_run_in_a_live_runs_directory_is_refused_and_touches_nothing(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    first = start(tiny_args(data_dir, run_dir, "train.max_steps=100000"))
    try:
        wait_for_steps(run_dir, 2, first)
        # what the live run itself appends as it trains: its metrics, its log lines
        live = lambda name: name in ("metrics.jsonl", "dtrain.log") or name.startswith("logs/")  # noqa: E731
        for extra in ([], ["optim.lr=1e-3"], ["resume=never"]):  # the same command, or another run
            before = {name: data for name, data in snapshot(run_dir).items() if not live(name)}
            line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=100000", *extra)))
            assert "in use by another dtrain run" in line and f"pid {first.pid}" in line, line
            after = {name: data for name, data in snapshot(run_dir).items() if not live(name)}
            assert after == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.slow
def test_a_finished_run_is_not_run_again_and_max_steps_cannot_change(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4"), check=True)
    before = snapshot(run_dir)
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4"))
    assert proc.returncode == 0, proc.stderr
    assert "already finished" in proc.stdout and "nothing to do" in proc.stdout, proc.stdout
    assert snapshot(run_dir) == before  # nothing appended, nothing rewritten
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=8")))
    assert "train.max_steps=4" in line and "schedule" in line, line
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4", "optim.lr=1e-3")))
    assert "another run's outputs" in line and "optim.lr" in line, line
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_a_crashed_run_without_a_checkpoint_is_continued_by_the_same_command(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=12")  # crashed at step 2: far from the end
    crashed = start(args)
    wait_for_steps(run_dir, 2, crashed)
    os.killpg(crashed.pid, signal.SIGKILL)
    crashed.wait()
    record = (run_dir / "resolved_config.json").read_text()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    run_dtrain(args, check=True)
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, 13))  # started over: every step once, none from the crashed attempt twice
    assert (run_dir / "resolved_config.json").read_text() == record
    summary = [r for r in read_metrics(run_dir) if "summary" in r]
    assert len(summary) == 1 and json.dumps(summary[0]["summary"])


def test_every_schema_key_is_trajectory_or_operational_once():
    """trainer/config/keys.py classifies every key of the schema (with every optional block filled
    in), so none is left to chance when a run continues."""
    config = OmegaConf.to_container(compose(["optim=muon"]), resolve=True)
    keys = dotted_keys(config)
    assert "optim.muon.lr" in keys and "checkpoint.keep" in keys
    # a key both tables match is one an operational entry names inside a trajectory section
    both = [k for k in keys if _matches(k, TRAJECTORY) and _matches(k, OPERATIONAL) and k not in OPERATIONAL]
    neither = [k for k in keys if key_kind(k) is None]
    assert not both and not neither and not set(TRAJECTORY) & set(OPERATIONAL), (both, neither)
    for key in ("checkpoint.keep", "checkpoint.interval", "train.log_interval", "train.val_interval",
                "eval.hellaswag.path", "logger", "world", "parallel.mode", "model.attention"):
        assert key_kind(key) == "operational", key
    for key in ("train.max_steps", "optim.lr", "optim.muon.lr", "train.seed", "model.n_layer", "data.name",
                "train.micro_batch_size", "train.dtype", "train.on_nonfinite"):
        assert key_kind(key) == "trajectory", key


@pytest.mark.slow
def test_changed_operational_keys_continue_a_killed_run_bitwise(data_dir, tmp_path):
    """kill -9, then the same command keeping fewer checkpoints, saving and logging at other
    intervals: it continues, says what changed, and ends bitwise equal to an uninterrupted run."""
    base = ("train.max_steps=12", "checkpoint.interval=2")  # killed past step 6, 6 steps left
    reference = tmp_path / "reference"
    run_dtrain(tiny_args(data_dir, reference, *base), check=True)
    run_dir = tmp_path / "run"
    killed = start(tiny_args(data_dir, run_dir, *base))
    wait_for_steps(run_dir, 6, killed)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    changed = ("checkpoint.keep=1", "checkpoint.interval=4", "train.log_interval=2")
    proc = run_dtrain(tiny_args(data_dir, run_dir, *base, *changed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert ("with changed settings: checkpoint.interval 2 -> 4, checkpoint.keep 3 -> 1, "
            "train.log_interval 1 -> 2") in said, said
    record = json.loads((run_dir / "resolved_config.json").read_text())
    assert record["checkpoint"]["keep"] == 1 and record["train"]["log_interval"] == 2
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(reference) if "loss" in r}
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}
    assert got[12] == want[12] and all(got[s] == want[s] for s in got), (got, want)
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000012"]  # keep=1
    assert same_weights(run_dir, reference)


@pytest.mark.parametrize("change, named", [("train.max_steps=8", "train.max_steps=4"),
                                           pytest.param("optim.lr=1e-3", "optim.lr", marks=pytest.mark.slow)])
def test_a_changed_trajectory_key_names_resume_path(change, named, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4", "checkpoint.interval=2"), check=True)
    before = snapshot(run_dir)
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4", change)))
    assert named in line and f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("args, needle", [
    (["logger=[tensorboard,tensorboard]"], "names tensorboard twice"),
    (["launch.rdzv_endpoint=localhost:70000"], "port must be a number in 1-65535"),
    (["launch.rdzv_endpoint=localhost:0", "launch.nnodes=2", "world=2"], "port must be a number in 1-65535"),
    (["launch.rdzv_endpoint=node0:http"], "port must be a number in 1-65535"),
])
def test_small_frictions_are_one_line_and_write_nothing(args, needle, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, *args)))
    assert needle in line, line
    assert not run_dir.exists()


def test_resume_naming_a_file_says_it_is_a_file(data_dir, tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"not a checkpoint")
    run_dir = tmp_path / "run"
    line = one_error_line(run_dtrain(tiny_args(data_dir, run_dir, f"resume={path}")))
    assert f"{path} is a file, not a checkpoint" in line, line
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_resume_into_a_folder_holding_another_run_is_refused(data_dir, references, tmp_path):
    """`resume=<run A's checkpoint> hydra.run.dir=<B>`, B holding another finished run (seed 7): one
    line naming what B holds and both ways on; nothing of B touched (issue 45: its oldest checkpoint
    was deleted and its metrics.jsonl rewritten). The same resume into a new folder starts a run there
    that tracks A bitwise; typed again once it finished it does nothing; after a crash it goes on from
    that folder's own newest checkpoint, not from A's again."""
    a = references("none")  # 8 steps, checkpoints 3, 6 and 8
    b = tmp_path / "b"
    run_dtrain(tiny_args(data_dir, b, *CKPT_ARGS, "train.seed=7"), check=True)
    before = snapshot(b)
    start_from = a / "checkpoints" / "step_000003"
    fork = lambda run_dir: tiny_args(data_dir, run_dir, *CKPT_ARGS, f"resume={start_from}")  # noqa: E731
    line = one_error_line(run_dtrain(fork(b)))
    assert f"run directory {b} holds another run (resolved_config.json, metrics.jsonl, 3 checkpoints)" in line, line
    assert f"resume={start_from} is not one of its checkpoints" in line and f"resume={b} to continue" in line, line
    assert snapshot(b) == before

    f = tmp_path / "f"  # a new folder: the run goes on there from A's step 3
    run_dtrain(fork(f), check=True)
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(a) if "loss" in r}
    assert {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(f) if "loss" in r} == {
        s: want[s] for s in range(4, 9)}
    done = snapshot(f)
    again = run_dtrain(fork(f))
    assert again.returncode == 0 and f"run {f} already finished" in again.stdout, again.stdout + again.stderr
    assert snapshot(f) == done

    crashed = tmp_path / "crashed"  # f killed after its step-6 checkpoint, then the same command
    crashed_copy(f, crashed, 6)
    resumed = run_dtrain(fork(crashed), check=True)
    assert f"resuming from {crashed / 'checkpoints' / 'step_000006'}" in resumed.stderr, resumed.stderr[-3000:]
    assert {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(crashed) if "loss" in r} == {
        s: want[s] for s in range(4, 9)}
