"""`dtrain train [overrides]`: one run, a sweep (`-m`), or Hydra's --cfg / --info / --help.

Everything goes through Hydra's public entry point, `hydra.main`, so Hydra's own flags
(--config-dir, --config-path, --config-name, hydra.searchpath) mean what they mean in any Hydra app.
Before it runs, the same flags and overrides are composed with Hydra's public compose API and the
run is claimed (trainer.preflight.claim: every check, the run directory taken, resolved_config.json): only
then does `hydra.main` write its `.hydra/` record and dtrain.log and call `train_job`. A sweep checks
every point as far as it can first; each point claims its own folder; `trainer.launch.sweep` keeps each
point's status. Under plain torchrun, rank 0's worker claims the run (trainer.train.worker.torchrun_main).
"""

from __future__ import annotations

import atexit
import copy
import shlex
import shutil
import tempfile
from pathlib import Path

from omegaconf import open_dict, read_write
from rich.console import Console

from trainer.config.command_line import check_hydra_flags, config_source, expand_seeds, is_informational, split_args
from trainer.config.compose import anchor_paths, compose, env_flag, hydra_job, run_hydra_app, sweep_points, swept_keys
from trainer.config.keys import apply_renamed_keys
from trainer.config.schema import requested_world, to_dict
from trainer.config.validation import validate
from trainer.errors import UserError
from trainer.io import folder_setting, write_errors_as_user_errors
from trainer.launch.sweep import finish_sweep, holding_sweep_dir, pin_sweep_dir, plugin_hint, run_point
from trainer.preflight.claim import check_sweep_point, claim_run
from trainer.preflight.run_tokenizer import pin_run_tokenizer
from trainer.preflight.rundir import RunDirLock, RunDirState, finished_message
from trainer.process.env import CONTINUE_COMMAND_ENV, is_secondary_rank, under_torchrun

# Under plain torchrun only rank 0 writes the run directory; the config that counts is rank 0's,
# broadcast when the process group is up. The other ranks run Hydra in a scratch folder, silently.
SECONDARY_RANK_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=disabled",
                            "hydra/hydra_logging=disabled")


def cmd_train(args: list[str]) -> None:
    source = config_source(args)
    with plugin_hint():
        check_hydra_flags(args)
        overrides, multirun = split_args(args)
        args = expand_seeds(args, multirun)  # sweep.seeds=N: the axis train.seed=0,...,N-1
        overrides, _ = split_args(args)
        if is_informational(args):
            _check_printed_config(overrides, multirun, source)
            run_hydra_app(args, train_job)  # Hydra prints the help, the info or the config; nothing runs
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
    if is_secondary_rank():
        extra = [f"hydra.run.dir={_scratch_dir()}", *SECONDARY_RANK_OVERRIDES]
        overrides, args = [*overrides, *extra], [*args, *extra]
    cfg = compose(overrides, return_hydra_config=True, source=source)
    anchor_paths(cfg, chdir=cfg.hydra.job.chdir)
    job_cfg = _without_hydra(cfg)
    run_dir = folder_setting("hydra.run.dir", cfg.hydra.run.dir)
    # hydra.main composes again: the folder is pinned, so a `${now:}` in it cannot tick in between
    args = _pinned(args, "hydra.run.dir", str(run_dir))
    if under_torchrun():  # rank 0 checks and claims the run inside the worker and tells the others
        if not is_secondary_rank():  # its worker's config is composed from args: the tokenizer pinned there too
            pin = pin_run_tokenizer(job_cfg, run_dir)
            if pin is not None:
                Console(stderr=True).print(f"dtrain: {pin.note}", highlight=False, soft_wrap=True)
        validate(job_cfg)
        run_app(_with_claimed_tokenizer(args, job_cfg))
        return
    world = requested_world(job_cfg)
    with RunDirLock(run_dir) as lock:  # held until the run ends: one run per directory
        # A full disk or a refused write while the run is claimed or Hydra sets it up is one line,
        # and what they made is removed again.
        with write_errors_as_user_errors(run_dir, "choose another hydra.run.dir="):
            state = claim_run(job_cfg, run_dir, world, lock)
            if state is RunDirState.FINISHED:
                Console().print(f"dtrain: {finished_message(run_dir)}", highlight=False, soft_wrap=True)
                return
            _announce(state, run_dir)
            # The command that continues this run, for the line a stop signal prints (workers inherit it).
            with env_flag(CONTINUE_COMMAND_ENV, continue_command(args, overrides, run_dir)):
                run_app(_with_claimed_tokenizer(args, job_cfg))


def _with_claimed_tokenizer(args: list[str], job_cfg) -> list[str]:
    """args with the tokenizer.checkpoint the claim pinned (a continuation whose tokenizer folder moved:
    trainer/preflight/run_tokenizer.py), so that hydra.main composes the config the checks passed
    (under plain torchrun: the config rank 0's worker claims and every rank trains with)."""
    pinned = job_cfg.tokenizer.get("checkpoint")
    return _pinned(args, "tokenizer.checkpoint", str(pinned)) if pinned else args


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


def _pinned(args: list[str], key: str, value: str) -> list[str]:
    """args with `key=value` in place of any value given (beside the other overrides: Hydra's
    argparse takes them as one run of positionals)."""
    quoted = value.replace("'", "\\'")
    kept = [a for a in args if not a.startswith(f"{key}=")]
    overrides, _ = split_args(kept)
    at = kept.index(overrides[0]) if overrides else len(kept)
    return [*kept[:at], f"{key}='{quoted}'", *kept[at:]]


def run_app(args: list[str], job=None):
    """Hydra's own entry point on args: it makes the run directory, writes .hydra/ and dtrain.log
    and calls train_job. The run's exception is raised here as it is, not printed by Hydra with
    'Error executing job with overrides' above the one `error:` line; an error of Hydra's own (a
    write it could not make) comes through whole for write_errors_as_user_errors
    (HYDRA_FULL_ERROR: Hydra's documented switch to raise instead of print)."""
    outcome: list = []  # what `job` (train_job by default) returned, or the exception it raised
    job = job or train_job

    def task(cfg) -> None:
        try:
            apply_renamed_keys(cfg)  # hydra.main's own composition; the checks' compose gave the notice
            outcome.append(job(cfg))
        except BaseException as err:  # Stopped and KeyboardInterrupt too: they end the command
            outcome.append(err)

    with env_flag("HYDRA_FULL_ERROR", "1"):
        run_hydra_app(args, task)
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0] if outcome else None


def _sweep(args: list[str], overrides: list[str], source) -> None:
    for point in sweep_points(overrides):
        check_sweep_point(compose(point, source=source))  # before the sweep folder, which Hydra makes
    args, sweep_dir = pin_sweep_dir(args)  # where the points go, known up front
    with holding_sweep_dir(sweep_dir):  # one sweep per folder, as one run per run directory
        try:
            run_hydra_app(args, train_job)
        finally:
            if sweep_dir is not None:  # the sweep's table, also when a point failed or it was interrupted
                finish_sweep(sweep_dir)


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


def train_job(cfg) -> float:
    """Hydra's task function: one training run (one point of a sweep). Returns best val loss."""
    run_dir, sweep_point = hydra_job(cfg)  # hydra.main composed it again: anchored as the checks' was
    if sweep_point is not None:  # status file, summary.jsonl, skip finished / resume unfinished
        return run_point(cfg, sweep_point, lambda lock: _train_point(cfg, run_dir, lock))
    return run_training(cfg, run_dir)["best_val_loss"]


def _train_point(cfg, run_dir: Path, lock: RunDirLock | None) -> dict:
    """One sweep point in its folder: claimed under `lock` (the point's, which its sweep holds),
    then trained. Under plain torchrun (no lock here) rank 0's worker claims it."""
    if lock is not None and claim_run(cfg, run_dir, requested_world(cfg), lock) is RunDirState.FINISHED:
        return {}
    return run_training(cfg, run_dir)


def run_training(cfg, run_dir: Path) -> dict:
    """Train a claimed run with cfg in run_dir on the requested workers; returns rank 0's figures.
    Under plain torchrun this process is one of the workers, and rank 0's claims the run."""
    # the torch side of dtrain: imported once the checks have passed
    from trainer.launch.workers import run_workers
    from trainer.train.worker import torchrun_main, worker_main

    cfg_dict = to_dict(cfg)
    if under_torchrun():
        return torchrun_main(cfg_dict, str(run_dir))
    return run_workers(worker_main, (cfg_dict, str(run_dir)), cfg_dict["launch"], requested_world(cfg),
                       run_dir / "logs", stop_signals=True)
