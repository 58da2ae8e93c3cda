"""End-to-end runs as a user starts them: `dtrain train`, plain torchrun, the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args, train_losses
from helpers.runs import CKPT_ARGS


def test_tiny_run_learns_logs_validates_and_samples(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=30", "train.log_interval=5",
                                "train.val_interval=10", "train.sample_tokens=12", "optim.lr=2e-3"), check=True)
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 5, 10, 15, 20, 25, 30]
    for r in train:
        assert {"step", "tokens", "loss", "lr", "tokens_per_s", "grad_norm"} <= r.keys()
        assert r["tokens"] == r["step"] * 4 * 64
    assert train[-1]["loss"] < train[0]["loss"] - 0.75  # from chance, ln(512) = 6.24
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [10, 20, 30] and vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert records[-1]["summary"]["steps"] == 30
    assert "sample:" in proc.stdout and "run summary" in proc.stdout
    config = json.loads((run_dir / "resolved_config.json").read_text())
    assert config["model"]["n_layer"] == 2 and config["train"]["max_steps"] == 30


@pytest.mark.slow
def test_plain_torchrun_runs_the_same_loop(data_dir, references, tmp_path):
    """torchrun's own launch of the loop tracks `dtrain train parallel=ddp world=2` (the session's
    reference run of test_checkpoint, the same command but for world=)."""
    run_dir = tmp_path / "torchrun"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "trainer", *tiny_args(data_dir, run_dir, *CKPT_ARGS, "parallel=ddp")]
    proc = subprocess.run(torchrun, cwd=REPO, capture_output=True, text=True, timeout=300, env=dtrain_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses, expected = train_losses(run_dir), train_losses(references("ddp"))
    assert losses.keys() == expected.keys()
    assert max(abs(losses[s] - expected[s]) for s in expected) < 1e-6
    # only rank 0's run dir exists; the others' configs were replaced by rank 0's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torchrun"]


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "dtrain"
    assert script.exists() or shutil.which("dtrain")
    proc = subprocess.run([str(script) if script.exists() else "dtrain", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: dtrain" in proc.stdout


EXIT_HOOK = """
import atexit, gc, os, sys
def _report():
    with open(os.environ["DTRAIN_TEST_EXITS"], "a") as log:
        log.write(f"{os.getpid()} {os.getppid()} {gc.get_freeze_count()} {' '.join(sys.argv)}\\n")
atexit.register(_report)
"""


@pytest.mark.slow
def test_the_command_and_its_workers_leave_without_a_final_collection(data_dir, tmp_path):
    """The console script and each worker freeze their objects before they exit (trainer.cli.run,
    trainer.launch.workers.worker_process), which spares them the interpreter's last collections over all
    of torch (~0.3 s a process); counted at exit by a sitecustomize in every process. Spawned workers:
    forked ones (the default, trainer/launch/forkserver.py) leave through os._exit, with no interpreter
    shutdown at all."""
    hook, exits = tmp_path / "hook", tmp_path / "exits.txt"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(EXIT_HOOK)
    env = {**dtrain_env(), "PYTHONPATH": f"{hook}:{REPO}", "DTRAIN_TEST_EXITS": str(exits)}
    script = Path(sys.executable).parent / "dtrain"
    args = tiny_args(data_dir, tmp_path / "run", "train.max_steps=2", "parallel=ddp", "world=2",
                     "launch.start_method=spawn")
    proc = subprocess.run([str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # pid, parent pid, objects frozen, argv (spawned workers carry the driver's argv)
    reports = [line.split(" ", 3) for line in exits.read_text().splitlines()]
    (driver,) = [(pid, int(count)) for pid, parent, count, _ in reports if int(parent) == os.getpid()]
    workers = [int(count) for _, parent, count, argv in reports if parent == driver[0] and argv.startswith(str(script))]
    assert len(workers) == 2, reports  # besides them, the driver's resource tracker (python -c), which does not
    assert driver[1] > 0 and all(count > 0 for count in workers), reports
