"""`dtrain train [overrides]`: one run, a sweep (`-m`), or Hydra's --cfg / --info / --help.

A run's config is composed once, with Hydra's public compose API and the flags Hydra reads
(--config-dir, --config-path, --config-name, hydra.searchpath): the run is claimed from it
(trainer.preflight.claim: every check, the run directory taken, resolved_config.json), and only then
does Hydra's own job runner (`hydra.core.utils.run_job`, what Hydra's launchers call) write its
`.hydra/` record and dtrain.log from that same config and call `fit`. A sweep goes through
Hydra's multirun entry point (`hydra.main`), whose launcher composes each point: it checks every
point as far as it can first; each point claims its own folder; `trainer.launch.sweep` keeps each
point's status. --cfg, --info and --help are Hydra's own printing (`hydra.main` too). Under plain
torchrun, rank 0's worker claims the run (trainer.fit.worker.torchrun_main).
"""

from __future__ import annotations

import atexit
import copy
import shlex
import shutil
import tempfile
from functools import partial
from pathlib import Path

from omegaconf import DictConfig, open_dict, read_write
from rich.console import Console

from trainer.config.batch import requested_world
from trainer.config.command_line import (
    check_hydra_flags,
    config_source,
    expand_seeds,
    is_informational,
    split_args,
)
from trainer.config.compose import (
    anchor_paths,
    compose,
    env_flag,
    hydra_job,
    run_as_hydra_job,
    run_hydra_app,
    sweep_points,
    swept_keys,
)
from trainer.config.keys import apply_renamed_keys
from trainer.config.schema import to_dict
from trainer.errors import UserError
from trainer.io import folder_setting, write_errors_as_user_errors
from trainer.launch.sweep import finish_sweep, holding_sweep_dir, pin_sweep_dir, plugin_hint, run_point
from trainer.preflight.claim import check_sweep_point, check_torchrun_rank, claim_run
from trainer.preflight.run_tokenizer import pin_run_tokenizer
from trainer.preflight.rundir import RunDirLock, RunDirState, finished_message
from trainer.process.collector import collector_paused
from trainer.process.env import CONTINUE_COMMAND_ENV, is_secondary_rank, under_torchrun

# Under plain torchrun only rank 0 writes the run directory; the config that counts is rank 0's,
# broadcast when the process group is up. The other ranks run their job in a scratch folder, silently.
SECONDARY_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=disabled",
                            "hydra/hydra_logging=disabled")


def cmd_train(args: list[str]) -> None:
    source = config_source(args)
    with plugin_hint():
        check_hydra_flags(args)
        overrides, multirun = split_args(args)
        expanded = expand_seeds(args, multirun)  # sweep.seeds=N: the axis train.seed=0,...,N-1
        if expanded is not args:
            args, overrides = expanded, split_args(expanded)[0]
        if is_informational(args):
            _check_printed_config(overrides, multirun, source)
            run_hydra_app(args, fit_sweep_point)  # Hydra prints the help, the info or the config; nothing runs
        elif multirun:
            _sweep(args, overrides, source)
        else:
            _single_run(args, overrides, source)


def _check_printed_config(overrides: list[str], multirun: bool, source) -> None:
    """The config that --help, --cfg or --info prints composes: an unknown config, key or value is
    one line, not Hydra's page or traceback. Hydra's help composes one config, not a sweep's."""
    swept = swept_keys(overrides) if multirun else []
    if swept:
        raise UserError(f"--help shows one composed config, and -m sweeps {', '.join(swept)}: give each key "
                        "one value to see it in the help")
    compose(overrides, source=source)


def _single_run(args: list[str], overrides: list[str], source) -> None:
    """One run: composed once, claimed, then fitted as Hydra's job from that config."""
    if is_secondary_rank():
        overrides = [*overrides, f"hydra.run.dir={_scratch_dir()}", *SECONDARY_RANK_OVERRIDES]
    cfg = compose([*overrides, "hydra.mode=RUN"], return_hydra_config=True, source=source)
    anchor_paths(cfg, chdir=cfg.hydra.job.chdir)
    run_dir = folder_setting("hydra.run.dir", cfg.hydra.run.dir)
    with read_write(cfg.hydra):  # resolved once: a `${now:}` in it does not tick before Hydra makes it
        cfg.hydra.run.dir = str(run_dir)
    job_cfg = _without_hydra(cfg)
    if under_torchrun():  # rank 0 checks and claims the run inside the worker and tells the others
        if not is_secondary_rank():
            pin = pin_run_tokenizer(job_cfg, run_dir)
            if pin is not None:
                Console(stderr=True).print(f"dtrain: {pin.note}", highlight=False, soft_wrap=True)
        check_torchrun_rank(job_cfg)
        run_as_hydra_job(_with_hydra(job_cfg, cfg), source, partial(fit, run_dir=run_dir))
        return
    with RunDirLock(run_dir) as lock:  # held until the run ends: one run per directory
        # A full disk or a refused write while the run is claimed or Hydra sets it up is one line,
        # and what they made is removed again.
        with write_errors_as_user_errors(run_dir, "choose another hydra.run.dir="):
            state = claim_run(job_cfg, run_dir, requested_world(job_cfg), lock)
            if state is RunDirState.FINISHED:
                Console().print(f"dtrain: {finished_message(run_dir)}", highlight=False, soft_wrap=True)
                return
            _announce(state, run_dir)
            # The command that continues this run, for the line a stop signal prints (workers inherit it).
            with env_flag(CONTINUE_COMMAND_ENV, continue_command(args, overrides, run_dir)):
                # as claimed: a continuation's tokenizer pinned to its checkpoint's copy
                run_as_hydra_job(_with_hydra(job_cfg, cfg), source, partial(fit, run_dir=run_dir))


def _announce(state: RunDirState, run_dir: Path) -> None:
    if state is RunDirState.CONTINUE:
        Console(stderr=True).print(f"dtrain: continuing the run in {run_dir} (hydra.run.dir=ANOTHER_DIR "
                                   "starts afresh)", highlight=False, soft_wrap=True)


def continue_command(args: list[str], overrides: list[str], run_dir: Path) -> str:
    """`dtrain train ...` as typed, with the run directory named where the command did not name
    it and its default would not find it again (a folder of the user's with `${now:}` in it)."""
    typed = [a for a in args if not a.startswith("hydra.run.dir=")]
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        typed.append(f"hydra.run.dir={run_dir}")
    return shlex.join(["dtrain", "train", *typed])


def _sweep(args: list[str], overrides: list[str], source) -> None:
    for point in sweep_points(overrides):
        check_sweep_point(compose(point, source=source))  # before the sweep folder, which Hydra makes
    args, sweep_dir = pin_sweep_dir(args)  # where the points go, known up front
    with holding_sweep_dir(sweep_dir):  # one sweep per folder, as one run per run directory
        try:
            run_hydra_app(args, fit_sweep_point)
        finally:
            if sweep_dir is not None:  # the sweep's table, also when a point failed or it was interrupted
                finish_sweep(sweep_dir)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    """The composed config without its `hydra` section: what the run itself reads."""
    job = copy.deepcopy(cfg)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job


def _with_hydra(job_cfg: DictConfig, cfg: DictConfig) -> DictConfig:
    """job_cfg (as claimed) with cfg's `hydra` section: what Hydra's job runner takes."""
    full = copy.deepcopy(job_cfg)
    with read_write(full), open_dict(full):
        full["hydra"] = copy.deepcopy(cfg.hydra)
    return full


def _scratch_dir() -> str:
    scratch = tempfile.mkdtemp(prefix="dtrain-rank")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def fit_sweep_point(cfg) -> float:
    """Hydra's task function for each point of a sweep (Hydra's launcher composed it): claimed in
    its folder and fitted. Returns the point's best val loss, the sweep's objective."""
    apply_renamed_keys(cfg)  # the checks' compose gave the notice
    run_dir, sweep_point = hydra_job(cfg)  # its paths anchored as the checks' were
    return run_point(cfg, sweep_point, lambda lock: _fit_point(cfg, run_dir, lock))


def _fit_point(cfg, run_dir: Path, lock: RunDirLock | None) -> dict:
    """One sweep point in its folder: claimed under `lock` (the point's, which its sweep holds),
    then fitted. Under plain torchrun (no lock here) rank 0's worker claims it."""
    if lock is not None and claim_run(cfg, run_dir, requested_world(cfg), lock) is RunDirState.FINISHED:
        return {}
    return fit(cfg, run_dir)


def fit(cfg, run_dir: Path) -> dict:
    """Fit a claimed run with cfg in run_dir on the requested workers; returns rank 0's figures.
    Under plain torchrun this process is one of the workers, and rank 0's claims the run."""
    # the torch side of dtrain: imported once the checks have passed
    with collector_paused():
        from trainer.fit.worker import torchrun_main, worker_main
        from trainer.launch.workers import run_workers

    cfg_dict = to_dict(cfg)
    if under_torchrun():
        return torchrun_main(cfg_dict, str(run_dir))
    return run_workers(worker_main, (cfg_dict, str(run_dir)), cfg_dict["launch"], requested_world(cfg),
                       run_dir / "logs", stop_signals=True)
