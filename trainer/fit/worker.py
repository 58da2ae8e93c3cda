"""A worker process: the same Trainer under dtrain's launcher, in-process, or under plain torchrun.

    worker_main     a run its driver already claimed (dtrain's launcher, or one worker in-process)
    torchrun_main   plain torchrun: every rank composed its own config; rank 0 claims the run
                    (trainer.preflight.claim) and all ranks go on with its config and run directory
"""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from trainer.checkpoint.manager import Checkpointer
from trainer.config.batch import mesh_shape
from trainer.config.schema import from_dict, to_dict
from trainer.errors import Stopped
from trainer.fit.loop import Trainer
from trainer.parallel import strategy_class
from trainer.preflight.claim import claim_run
from trainer.preflight.rundir import RunDirLock, RunDirState, finished_message
from trainer.process.collector import collector_paused
from trainer.process.hang_watch import flight_recorder_env
from trainer.process.runtime import Runtime, init_runtime, pick_device
from trainer.process.signals import StopSignals


def worker_main(cfg_dict: dict, run_dir: str) -> dict:
    """Train on this rank; returns the run's figures (rank 0's are the ones reported).

    Module level and picklable: torchrun's engine spawns it in every worker process. A stop signal
    ends it as Stopped, once every rank has stopped at the same step and the checkpoint is saved.
    """
    with _this_rank(cfg_dict, Path(run_dir)) as (cfg, rt):
        return asdict(Trainer(cfg, rt, Path(run_dir), Checkpointer(cfg, rt, Path(run_dir))).fit())


def torchrun_main(cfg_dict: dict, run_dir: str) -> dict:
    """Plain torchrun's worker (every rank ran `dtrain train` itself): rank 0 claims the run, and
    its config and run directory reach every rank, so all ranks agree on both; its user error is
    raised on every rank. Returns the run's figures ({} when the run had finished already)."""
    lock = RunDirLock(Path(run_dir))  # rank 0 holds the run directory's lock for the run's life
    try:
        with _this_rank(cfg_dict, Path(run_dir)) as (cfg, rt):
            def claim() -> tuple[dict, str, bool]:
                finished = claim_run(cfg, Path(run_dir), rt.world, lock) is RunDirState.FINISHED
                if finished:
                    print(f"dtrain: {finished_message(Path(run_dir))}", flush=True)
                return to_dict(cfg), run_dir, finished  # as claimed: a continuation's tokenizer pinned

            claimed_cfg, claimed_dir, finished = rt.from_main(claim)
            if finished:
                return {}
            cfg, run = from_dict(claimed_cfg), Path(claimed_dir)
            return asdict(Trainer(cfg, rt, run, Checkpointer(cfg, rt, run)).fit())
    finally:
        lock.release()


@contextmanager
def _this_rank(cfg_dict: dict, run_dir: Path) -> Iterator[tuple[DictConfig, Runtime]]:
    """The config and this rank's runtime (process group, device, threads) with its stop signals,
    and the teardown after the run, whatever ended it."""
    # First of all: a stop signal or the launcher's death while the process group comes up is
    # already handled (see trainer.process.signals).
    stop = StopSignals(int(os.environ.get("RANK", 0))).install()
    with collector_paused():
        # Building any torch.optim optimizer imports torch._dynamo (docs/performance.md, "Start-up"):
        # here first, with the collector paused, where no forkserver imported it already (one
        # process in the driver, spawned workers, plain torchrun). The driver of workers never needs it.
        import torch._dynamo  # noqa: F401
    cfg = from_dict(cfg_dict)
    if pick_device(cfg.train.device, 0).type == "cuda":
        os.environ.update(flight_recorder_env(run_dir))  # before the process group reads them
    try:
        rt = init_runtime(
            cfg.train.device,
            strategy_class(cfg.parallel.mode).needs_process_group,
            cfg.launch.timeout_s,
            cfg.launch.threads_per_worker,
            mesh_shape(cfg, int(os.environ.get("WORLD_SIZE", 1))),
        )
    except BaseException:
        stop.uninstall(clean=False)
        raise
    stop.process_group_up()
    clean = interrupted = False
    try:
        yield cfg, rt
        clean = True
    except BaseException as err:
        # The traceback's frames keep the wrapped model alive; freeing a DDP model after its
        # gloo group is destroyed can deadlock at exit, so let go of it before the teardown.
        traceback.clear_frames(err.__traceback__)
        clean = isinstance(err, Stopped)  # every rank stopped at the same step, checkpoint saved
        interrupted = isinstance(err, KeyboardInterrupt)
        raise
    finally:
        stop.uninstall(clean)
        gc.collect()
        rt.shutdown(barrier=not interrupted)
