"""Claiming a run: the one way each of dtrain's launch paths starts one.

    claim_run:  a continuation's tokenizer pinned to its checkpoint's copy when its folder moved
                (run_tokenizer.py)
             -> the checks that need no torch (checks.py's check_run)
             -> the checks that need torch (torch_checks.py's check_with_torch)
             -> the run directory claimed (its lock taken, the folder made)
             -> the resolved config recorded (resolved_config.json)

Nothing is written before every check has passed. Who calls it, and when:

    a single run        the driver, before Hydra writes .hydra/ and dtrain.log (commands/train.py)
    a sweep point       the driver, in the point's folder under the lock its sweep took (commands/train.py)
    plain torchrun      rank 0's worker, which tells the other ranks its config and run directory
                        (trainer/fit/worker.py's torchrun_main)

A sweep also checks each point before its sweep folder exists (check_sweep_point), as far as that
can be known without the point's folder; the point then claims its folder with claim_run.
"""

from __future__ import annotations

from pathlib import Path

from trainer.config.batch import requested_world
from trainer.config.validation import validate
from trainer.evals.hellaswag_file import check_hellaswag_file
from trainer.optim.schedule import warmup_notice
from trainer.preflight.checks import check_data, check_run, record_config, say_notice
from trainer.preflight.run_tokenizer import pin_run_tokenizer
from trainer.preflight.rundir import RunDirLock, RunDirState
from trainer.process.collector import collector_paused


def claim_run(cfg, run_dir: Path, world: int, lock: RunDirLock) -> RunDirState:
    """Check everything, then claim `run_dir` for this run under `lock` (the run directory's, held
    by the caller for the run's life) and record its config; returns what the directory held. A
    finished run is neither claimed nor recorded (the caller says so and trains nothing)."""
    lock.probe()
    pin = pin_run_tokenizer(cfg, run_dir)  # before the checks: the vocabulary and the data folder follow it
    state = check_run(cfg, run_dir, world, lock)
    if state is RunDirState.FINISHED:
        return state
    _check_with_torch(cfg, world, run_dir)
    lock.claim()
    record_config(cfg, run_dir, pin)
    if pin is not None:
        say_notice(pin.note)
    notice = warmup_notice(cfg.optim, cfg.train.max_steps)
    if notice:
        say_notice(notice)
    return state


def check_sweep_point(cfg) -> None:
    """A sweep's point, checked before the sweep folder is made: its config, its data (without
    preparing it), a HellaSwag file it names and the checks that need torch, all but those of its
    run directory."""
    validate(cfg)
    world = requested_world(cfg)
    check_data(cfg, world, prepare_now=False)
    check_hellaswag_file(cfg, download_now=False)
    _check_with_torch(cfg, world, None)


def check_torchrun_rank(cfg) -> None:
    """Plain torchrun: every rank's config and its layout (mode x mesh x world), checked before Hydra
    makes rank 0's run directory (rank 0 claims the run later, in its worker, after the rest)."""
    validate(cfg)
    with collector_paused():
        from trainer.preflight.torch_checks import check_layout  # torch: see _check_with_torch

    check_layout(cfg, requested_world(cfg))


def _check_with_torch(cfg, world: int, run_dir: Path | None) -> None:
    # torch is imported only here, once the checks that need none have passed: a user error
    # found by those arrives without waiting for torch
    with collector_paused():
        from trainer.preflight.torch_checks import check_with_torch

    check_with_torch(cfg, world, run_dir)
