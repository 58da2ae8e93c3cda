"""`dtrain train [overrides]`: one run, a sweep (`-m`), or Hydra's --cfg / --help.

A single run composes its config once, checks everything (config, run directory, data, tokenizer,
the mode's worker count) and only then lets Hydra's own `run_job` make the run directory and its
`.hydra/` record and call `train_job`. A sweep checks every point the same way first, then runs
through `hydra.main` (its sweeper and launcher plugins); `trainer.sweep` keeps each point's status.
"""

from __future__ import annotations

import atexit
import copy
import shutil
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import hydra
from hydra._internal.callbacks import Callbacks
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, run_job
from hydra.types import HydraContext, RunMode
from omegaconf import open_dict, read_write
from rich.console import Console

from trainer.compose import CONFIG_NAME, anchor_paths, compose, compose_run, is_informational, split_args, sweep_points
from trainer.config import CONF_DIR, register_configs, requested_world, to_dict
from trainer.env import is_secondary_rank, under_torchrun
from trainer.preflight import check_run, preflight, record_config
from trainer.rundir import RunDirLock, RunDirState, finished_message
from trainer.sweep import finish_sweep, holding_sweep_dir, pin_sweep_dir, plugin_hint, run_point
from trainer.validation import validate
from trainer.writable import folder_setting, write_errors_as_user_errors

# Under plain torchrun only rank 0 writes the run directory; the config that counts is rank 0's,
# broadcast when the process group is up. The other ranks run Hydra in a scratch folder, silently.
SECONDARY_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=disabled",
                            "hydra/hydra_logging=disabled")


def cmd_train(args: list[str]) -> None:
    if is_informational(args):
        _hydra_main(args)  # Hydra prints the help or the config; nothing runs
        return
    with plugin_hint():
        overrides, multirun = split_args(args)
        if multirun:
            _sweep(args, overrides)
        else:
            _single_run(overrides)


def _single_run(overrides: list[str]) -> None:
    if is_secondary_rank():
        overrides = [*overrides, f"hydra.run.dir={_scratch_dir()}", *SECONDARY_RANK_OVERRIDES]
    hydra_app, cfg = compose_run(overrides)
    job_cfg = _without_hydra(cfg)
    run_dir = folder_setting("hydra.run.dir", cfg.hydra.run.dir)
    if under_torchrun():  # rank 0 checks and claims the run inside the worker and tells the others
        validate(job_cfg)
        _raise_failure(_start_job(hydra_app, cfg))
        return
    world = requested_world(job_cfg)
    with RunDirLock(run_dir) as lock:  # held until the run ends: one run per directory
        if check_run(job_cfg, run_dir, world, lock) is RunDirState.FINISHED:
            Console().print(f"dtrain: {finished_message(run_dir)}", highlight=False, soft_wrap=True)
            return
        check_launch(job_cfg, world)
        # A full disk or a refused write while Hydra sets the run up is one line, and what it made
        # is removed again; the run's own errors come back in the job's return value.
        with write_errors_as_user_errors(run_dir, "choose another hydra.run.dir="):
            lock.claim()
            job = _start_job(hydra_app, cfg)
        _raise_failure(job)


def _start_job(hydra_app, cfg) -> JobReturn:
    """Hydra's own run_job: makes the run directory, writes .hydra/ and dtrain.log, calls train_job."""
    context = HydraContext(config_loader=hydra_app.config_loader, callbacks=Callbacks(cfg))
    return run_job(task_function=train_job, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                   hydra_context=context)


def _raise_failure(job: JobReturn) -> None:
    """Raise the exception the run ended with, as it is (Hydra's own `job.return_value` would
    first write 'Error executing job with overrides: [...]' above the one `error:` line)."""
    if job.status == JobStatus.FAILED:
        raise job._return_value


def _sweep(args: list[str], overrides: list[str]) -> None:
    for point in sweep_points(overrides):
        cfg = compose(point)
        validate(cfg)
        check_launch(cfg, requested_world(cfg))
    args, sweep_dir = pin_sweep_dir(args)  # where the points go, known up front
    with holding_sweep_dir(sweep_dir):  # one sweep per folder, as one run per run directory
        try:
            _hydra_main(args)
        finally:
            if sweep_dir is not None:  # the sweep's table, also when a point failed or it was interrupted
                finish_sweep(sweep_dir)


def _hydra_main(args: list[str]) -> None:
    register_configs()
    sys.argv = ["dtrain", *args]
    hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base="1.3")(train_job)()


def _without_hydra(cfg):
    """The composed config without its `hydra` section: what the run itself reads."""
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job


def _scratch_dir() -> str:
    scratch = tempfile.mkdtemp(prefix="dtrain-rank")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def check_launch(cfg, world: int) -> None:
    """The checks that need torch (mode, device, resume's model, tracker credentials), still before
    anything is written."""
    # trainer.launch_checks imports torch: only once the checks that need no torch have passed
    from trainer.launch_checks import check_launch as check_with_torch

    check_with_torch(cfg, world)


def train_job(cfg) -> float:
    """Hydra's task function: one training run (one point of a sweep). Returns best val loss."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    anchor_paths(cfg)  # a sweep point is composed by Hydra's launcher, not by compose_run
    if hydra_cfg.mode == RunMode.MULTIRUN:  # status file, summary.jsonl, skip finished / resume unfinished
        return run_point(cfg, hydra_cfg, lambda lock: run_training(cfg, run_dir, checked=False, lock=lock))
    return run_training(cfg, run_dir, checked=True)["best_val_loss"]


def run_training(cfg, run_dir: Path, checked: bool, lock: RunDirLock | None = None) -> dict:
    """Train with cfg in run_dir on the requested workers; returns rank 0's figures. `checked`:
    this process already checked and claimed the run directory (a single run does so before
    Hydra writes anything); a sweep point is checked here, under `lock` (its sweep holds it)."""
    # the torch side of dtrain: imported once the checks have passed
    from trainer.launch import run_workers
    from trainer.worker import worker_main

    world = requested_world(cfg)
    cfg_dict = to_dict(cfg)
    if under_torchrun():
        return worker_main(cfg_dict, str(run_dir), preflight_done=False)
    if checked:
        record_config(cfg, run_dir)
        return run_workers(worker_main, (cfg_dict, str(run_dir)), cfg_dict["launch"], world, run_dir / "logs",
                           stop_signals=True)
    with RunDirLock(run_dir) if lock is None else nullcontext(lock) as lock:
        if preflight(cfg, run_dir, world, lock, check_launch) is RunDirState.FINISHED:
            return {}
        return run_workers(worker_main, (cfg_dict, str(run_dir)), cfg_dict["launch"], world, run_dir / "logs",
                           stop_signals=True)
