"""Sweeps (`dtrain train -m`): one full run per point, summary.jsonl and the end table, failed
points, fail_fast, re-runs that skip finished points and resume unfinished ones, a second start of a
live sweep refused, and a point whose sweep was killed shown as killed."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args
from helpers.processes import alive, finish, logged, start_dtrain, wait_for

from trainer.io import flock_held
from trainer.launch.sweep import SUMMARY_FILE, identity
from trainer.observe.results import STATUS_FILE, labels, live_status
from trainer.preflight.rundir import RunDirLock


def summary(sweep_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (sweep_dir / SUMMARY_FILE).read_text().splitlines()]


def output(proc) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_ddp_sweep_runs_each_point_distributed_then_a_rerun_skips_them(data_dir, tmp_path):
    # The default sweep dir (multirun/<swept keys>-<digest>) under a fresh working directory: the
    # only folder the sweep may create is that one (workers get the composed config, never compose).
    args = tiny_args(data_dir, None, "optim.lr=1e-3,3e-3", "parallel=ddp", "world=2", sweep=True)
    proc = run_dtrain(args, cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    assert sweep_dir.name.startswith("optim.lr-")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]

    points = summary(sweep_dir)
    assert [p["num"] for p in points] == [0, 1]
    assert [p["status"] for p in points] == ["ok", "ok"]
    assert ["optim.lr=0.001" in p["overrides"] for p in points] == [True, False]
    assert ["optim.lr=0.003" in p["overrides"] for p in points] == [False, True]
    for point in points:
        assert Path(point["run_dir"]) == (sweep_dir / str(point["num"])).resolve()
        records = read_metrics(sweep_dir / str(point["num"]))
        assert records[-1]["summary"]["steps"] == 6
        assert point["final_loss"] == pytest.approx(records[-1]["summary"]["final_loss"])
        assert point["best_val_loss"] == pytest.approx(min(r["val_loss"] for r in records if "val_loss" in r))
        assert point["tokens_per_s"] > 0 and point["wall_s"] > 0
        assert point["hellaswag_acc_norm"] is None
        # a distributed run: rank 1 logged through torchrun's engine into the point's own folder
        assert list((sweep_dir / str(point["num"]) / "logs").glob("*/attempt_0/1/stderr.log"))
    # the end table lists every point, labelled by the override that differs
    out = output(proc)
    assert "optim.lr=0.001" in out and "optim.lr=0.003" in out and "2 points: 2 ok" in out

    # the same command, typed again (issue 45, finding 17: it made another timestamped folder and
    # trained every point again): the same sweep dir, both points finished, nothing trained again
    before = {n: (sweep_dir / n / "metrics.jsonl").read_text() for n in ("0", "1")}
    again = run_dtrain(args, cwd=tmp_path)
    assert again.returncode == 0, output(again)
    assert output(again).count("finished earlier") == 2
    assert list((tmp_path / "multirun").iterdir()) == [sweep_dir]
    assert {n: (sweep_dir / n / "metrics.jsonl").read_text() for n in ("0", "1")} == before
    assert [p["status"] for p in summary(sweep_dir)] == ["ok", "ok"]

    # `make report` finds it (it looked for multirun/*/*/summary.jsonl only)
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    report = make_report(tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"report multirun/{sweep_dir.name}" in report.stdout
    assert (sweep_dir / "loss.png").exists()


def make_report(cwd: Path) -> subprocess.CompletedProcess:
    """The Makefile's `report` target, typed in `cwd`, with this checkout's dtrain: its setup
    prerequisite (the .venv stamp, newer than pyproject.toml) is met by a folder of its own."""
    (cwd / "pyproject.toml").symlink_to(REPO / "pyproject.toml")
    venv = cwd / "venv"
    venv.mkdir()
    (venv / ".installed-train").touch()
    # the make that runs these tests (make test-all ARGS=...) passes its variables down: not to this one
    env = {key: value for key, value in dtrain_env().items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(["make", "-s", "-f", str(REPO / "Makefile"), "report", f"VENV={venv}",
                           f"DTRAIN={sys.executable} -m trainer", "ARGS="], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow
def test_a_failed_point_is_recorded_and_the_sweep_goes_on(data_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    # lr=1e6 passes every check and fails in the worker at run time (the non-finite guard stops it)
    args = tiny_args(data_dir, sweep_dir, "optim.lr=1e6,1e-3", sweep=True)
    proc = run_dtrain(args)
    assert proc.returncode == 1, output(proc)
    failed, ok = summary(sweep_dir)
    assert failed["status"] == "failed" and "non-finite" in failed["error"]
    assert (sweep_dir / "0" / "error.txt").exists()
    assert ok["status"] == "ok" and ok["final_loss"] is not None
    out = output(proc)
    assert "sweep point #0 failed" in out and "1 failed, 1 ok" in out
    assert out.count("optim.lr=") >= 2  # both rows of the table

    # a re-run tries the failed point again and skips the finished one
    ok_metrics = (sweep_dir / "1" / "metrics.jsonl").read_text()
    again = run_dtrain(args)
    assert again.returncode == 1, output(again)
    assert "sweep point #1 finished earlier" in output(again)
    assert (sweep_dir / "1" / "metrics.jsonl").read_text() == ok_metrics
    assert [p["status"] for p in summary(sweep_dir)] == ["failed", "ok"]


@pytest.mark.slow
def test_fail_fast_stops_at_the_first_failed_point(data_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_dtrain(tiny_args(data_dir, sweep_dir, "sweep.fail_fast=true", "optim.lr=1e6,1e-3", sweep=True))
    assert proc.returncode == 1, output(proc)
    failed, skipped = summary(sweep_dir)
    assert failed["status"] == "failed"
    assert skipped["status"] == "skipped" and "fail_fast" in skipped["error"]
    assert not (sweep_dir / "1" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_rerun_resumes_an_unfinished_point_from_its_checkpoint(data_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = tiny_args(data_dir, sweep_dir, "checkpoint.interval=3", "optim.lr=1e-3", sweep=True)
    proc = run_dtrain(args)
    assert proc.returncode == 0, output(proc)
    point = sweep_dir / "0"
    checkpoints = point / "checkpoints"
    assert (checkpoints / "step_000003").is_dir(), sorted(path.name for path in checkpoints.iterdir())
    # make it look killed after step 3: the final checkpoint and everything logged later gone
    shutil.rmtree(checkpoints / "step_000006")
    kept = [r for r in read_metrics(point) if r["step"] <= 3]
    (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    status = json.loads((point / STATUS_FILE).read_text())
    (point / STATUS_FILE).write_text(json.dumps({**status, "status": "running"}))

    again = run_dtrain(args)
    assert again.returncode == 0, output(again)
    assert "resuming it from its checkpoint" in output(again)
    records = read_metrics(point)
    assert records[: len(kept)] == kept  # steps 1-3 were not trained again
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["summary"]["steps"] == 6
    (done,) = summary(sweep_dir)
    assert done["status"] == "ok"
    # its wall time is both starts', as its tokens and tokens/s are (the run's summary)
    end = records[-1]["summary"]
    assert done["wall_s"] == end["wall_s"] > end["session_wall_s"]
    assert done["tokens_per_s"] * done["wall_s"] == pytest.approx(done["tokens"])


def sweep_files(sweep_dir: Path) -> dict[str, str]:
    """The sweep's own records (what a second start must not touch) and whether its live point's
    metrics are in place (a second start used to move them aside into previous_attempt/)."""
    files = {str(p.relative_to(sweep_dir)): p.read_text() for p in sorted(sweep_dir.rglob("*"))
             if p.name in (STATUS_FILE, SUMMARY_FILE, "multirun.yaml", "error.txt")}
    return {**files, "entries": " ".join(sorted(str(p.relative_to(sweep_dir)) for p in sweep_dir.glob("*/*")
                                                if "previous_attempt" in p.name or p.name == "metrics.jsonl"))}


def report_status(sweep_dir: Path) -> list[str]:
    """The status column of `dtrain report SWEEP_DIR`, from the summary it prints (point #0 first)."""
    proc = run_dtrain(["report", str(sweep_dir)])
    assert proc.returncode == 0, output(proc)
    rows = [line.split("│") for line in proc.stdout.splitlines() if line.startswith("│ ")]
    return [row[3].strip() for row in rows if row[1].strip().isdigit()]


@contextmanager
def live_sweep(data_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path, list[str]]]:
    """A two-point sweep in its own process group, running its point #0 (a step logged); killed
    with kill -9 of the whole group on the way out. Yields the driver, the sweep folder and the command."""
    sweep_dir = tmp_path / "sweep"
    args = tiny_args(data_dir, sweep_dir, "optim.lr=1e-3,3e-3", "train.max_steps=100000", "checkpoint.interval=0",
                     sweep=True)
    log = tmp_path / "sweep.log"
    proc = start_dtrain(args, log)
    try:
        wait_for(lambda: logged(sweep_dir / "0"), proc, log)  # a step logged: report has a row to show
        yield proc, sweep_dir, args
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        finish(proc, log)


@pytest.mark.slow
def test_a_second_start_of_a_live_sweep_is_one_error_line_naming_the_holder(data_dir, tmp_path):
    """The old failure: the same sweep started again in its live folder marked the live point
    failed, moved its metrics aside and trained the next point beside it (exit 1, no error line)."""
    with live_sweep(data_dir, tmp_path) as (proc, sweep_dir, args):
        before = sweep_files(sweep_dir)
        try:  # refused in checks; it used to train the next point beside the live one
            again = run_dtrain(args, timeout=180)
        except subprocess.TimeoutExpired as err:
            raise AssertionError("the second start of the live sweep was not refused: it trained") from err
        assert again.returncode == 2, output(again)
        assert "Traceback" not in output(again), output(again)
        errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: sweep folder {sweep_dir} is in use by another dtrain sweep (pid {proc.pid}); "
                          "wait for it to end, or choose another hydra.sweep.dir="], again.stderr
        assert again.stderr.strip().splitlines()[-1] == errors[0]
        assert sweep_files(sweep_dir) == before  # nothing written, the live point untouched
        assert proc.poll() is None, "the first sweep did not survive the second start"


@pytest.mark.slow
def test_a_sweep_killed_with_kill_9_shows_its_point_killed(data_dir, tmp_path):
    """The old failure: after kill -9 of the sweep, `dtrain report` showed the point it was running
    as running (its status file says so; only a live process's lock on its folder can)."""
    with live_sweep(data_dir, tmp_path) as (proc, sweep_dir, _):
        assert report_status(sweep_dir) == ["running"]  # alive: the status file is right
        driver = proc.pid
    assert not alive(driver)
    assert json.loads((sweep_dir / "0" / STATUS_FILE).read_text())["status"] == "running"  # the file lies
    assert report_status(sweep_dir) == ["killed"]
    report = run_dtrain(["report", str(sweep_dir)])
    assert f"its sweep (pid {driver}) ended while it ran" in report.stdout, report.stdout


def test_a_sweep_dir_holding_another_sweep_is_refused_before_anything_runs(data_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "0").mkdir(parents=True)
    other = {"num": 0, "status": "ok", "overrides": ["optim.lr=0.5"]}
    (sweep_dir / "0" / STATUS_FILE).write_text(json.dumps(other))
    proc = run_dtrain(tiny_args(data_dir, sweep_dir, "optim.lr=1e-3,3e-3", sweep=True))
    assert proc.returncode == 2, output(proc)
    assert "holds another sweep" in proc.stderr and "optim.lr=0.5" in proc.stderr
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["0"]


def test_identity_ignores_sweep_and_hydra_settings():
    assert identity(["optim.lr=0.1", "sweep.fail_fast=true", "hydra.sweep.dir=x", "world=2"]) == [
        "optim.lr=0.1", "world=2"]


def test_labels_name_the_overrides_that_differ():
    runs = [["model=tiny", "optim.lr=0.001", "world=2"], ["model=tiny", "optim.lr=0.003", "world=2"]]
    assert labels(runs, ["0", "1"]) == (["optim.lr=0.001", "optim.lr=0.003"], ["model=tiny", "world=2"])
    assert labels([["model=tiny"]], ["run"]) == (["run"], ["model=tiny"])


def plugin_installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no hydra_plugins package at all
        return False


# A Python start-up hook that leaves one plugin out of the hydra_plugins namespace Hydra scans (a
# view of its folders without that one), as on a machine where the extra is not installed.
HIDE_PLUGIN = """
import os
import hydra_plugins
view = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hydra_plugins")
os.makedirs(view, exist_ok=True)
for root in list(hydra_plugins.__path__):
    for name in os.listdir(root):
        if name != os.environ["DTRAIN_TEST_HIDE_PLUGIN"] and not os.path.lexists(os.path.join(view, name)):
            try:
                os.symlink(os.path.join(root, name), os.path.join(view, name))
            except FileExistsError:  # another process of the run made it first
                pass
hydra_plugins.__path__ = [view]
"""


@pytest.mark.parametrize("override, extra, module", [
    ("hparams_search=optuna_lr", "optuna", "hydra_plugins.hydra_optuna_sweeper"),
    ("hydra/launcher=slurm", "slurm", "hydra_plugins.hydra_submitit_launcher"),
])
def test_a_missing_hydra_plugin_names_the_extra_to_install(override, extra, module, tmp_path):
    env = dtrain_env()
    if plugin_installed(module):  # installed here (CI installs the extras): hide it from this run
        hide = tmp_path / "hide"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text(HIDE_PLUGIN)
        env.update(PYTHONPATH=str(hide), DTRAIN_TEST_HIDE_PLUGIN=module.rsplit(".", 1)[1])
    proc = run_dtrain(["train", "-m", override, f"hydra.sweep.dir={tmp_path / 'sweep'}"], env=env)
    assert proc.returncode == 2
    assert f"pip install 'dtrain[{extra}]'" in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
@pytest.mark.skipif(not plugin_installed("hydra_plugins.hydra_optuna_sweeper"),
                    reason="the optional extra 'optuna' is not installed")
def test_optuna_search_minimises_the_best_val_loss(data_dir, tmp_path):
    from omegaconf import OmegaConf

    sweep_dir = tmp_path / "sweep"
    args = tiny_args(data_dir, sweep_dir, "hparams_search=optuna_lr", "hydra.sweeper.n_trials=2", sweep=True)
    proc = run_dtrain(args)
    assert proc.returncode == 0, output(proc)
    points = summary(sweep_dir)
    assert [p["status"] for p in points] == ["ok", "ok"]
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert best.best_value == pytest.approx(min(p["best_val_loss"] for p in points))
    # the seeded sampler proposes the same trials again: a re-run skips both
    again = run_dtrain(args)
    assert again.returncode == 0 and output(again).count("finished earlier") == 2, output(again)


def test_a_point_recorded_running_is_running_only_while_a_process_holds_its_folder(tmp_path):
    """In-process: a lock taken through another open file is what another process would see."""
    point = tmp_path / "0"
    point.mkdir()
    (point / STATUS_FILE).write_text(json.dumps({"num": 0, "status": "running", "pid": 4242}))
    lock = RunDirLock(point)
    lock.claim()
    assert flock_held(point) and live_status(point)["status"] == "running"
    lock.release()
    assert not flock_held(point)
    killed = live_status(point)
    assert killed["status"] == "killed" and "its sweep (pid 4242) ended while it ran" in killed["error"]
    assert json.loads((point / STATUS_FILE).read_text())["status"] == "running"  # reading writes nothing


def test_a_liveness_probe_at_the_moment_a_run_claims_its_folder_does_not_refuse_the_run(tmp_path):
    """`flock_held` takes a shared lock for an instant; a run claiming the folder just then waits it
    out instead of reporting the folder in use."""
    folder = tmp_path / "run"
    folder.mkdir()
    probe = os.open(folder, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)
    threading.Timer(0.05, os.close, [probe]).start()  # closing lets go of the probe's lock
    lock = RunDirLock(folder)
    lock.claim()
    assert flock_held(folder)
    lock.release()
