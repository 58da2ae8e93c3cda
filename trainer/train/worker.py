"""A worker process: the same entry point under dtrain's launcher, plain torchrun, or in-process."""

from __future__ import annotations

import gc
import os
import traceback
from dataclasses import asdict
from pathlib import Path

from trainer.checkpoint.manager import Checkpointer
from trainer.config.schema import from_dict
from trainer.errors import Stopped
from trainer.parallel import strategy_class
from trainer.preflight.checks import preflight
from trainer.preflight.rundir import RunDirLock, RunDirState, finished_message
from trainer.preflight.torch_checks import check_launch
from trainer.process.env import under_torchrun
from trainer.process.runtime import init_runtime
from trainer.process.signals import StopSignals
from trainer.train.loop import train


def worker_main(cfg_dict: dict, run_dir: str, preflight_done: bool = True) -> dict:
    """Train on this rank; returns the run's figures (rank 0's are the ones reported).

    Module level and picklable: torchrun's engine spawns it in every worker process.
    `preflight_done=False` (plain torchrun, where every rank composed its own config) makes rank 0
    prepare the run and broadcast its config and run dir, so all ranks agree on both.
    """
    # First of all: a stop signal or the launcher's death while the process group comes up is
    # already handled (see trainer.process.signals).
    stop = StopSignals(int(os.environ.get("RANK", 0))).install()
    cfg = from_dict(cfg_dict)
    try:
        rt = init_runtime(
            cfg.train.device,
            strategy_class(cfg.parallel.mode).needs_process_group,
            cfg.launch.timeout_s,
            cfg.launch.threads_per_worker,
        )
    except BaseException:
        stop.uninstall(clean=False)
        raise
    lock = RunDirLock(Path(run_dir))  # plain torchrun: rank 0 holds the run directory's lock
    clean = interrupted = False
    try:
        if not preflight_done:
            def prepare_run():
                finished = preflight(cfg, Path(run_dir), rt.world, lock, check_launch) is RunDirState.FINISHED
                if finished:
                    print(f"dtrain: {finished_message(Path(run_dir))}", flush=True)
                return cfg_dict, run_dir, finished

            cfg_dict, run_dir, finished = rt.from_main(prepare_run)
            if finished:
                clean = True
                return {}
            cfg = from_dict(cfg_dict)
        result = train(cfg, rt, Path(run_dir), Checkpointer(cfg, rt, Path(run_dir)))
        clean = True
        return asdict(result)
    except BaseException as err:
        # The traceback's frames keep the wrapped model alive; freeing a DDP model after its
        # gloo group is destroyed can deadlock at exit, so let go of it before the teardown.
        traceback.clear_frames(err.__traceback__)
        clean = isinstance(err, Stopped)  # every rank stopped at the same step, checkpoint saved
        interrupted = isinstance(err, KeyboardInterrupt)
        if clean and under_torchrun() and preflight_done:
            return {"stopped_by": err.signum}  # dtrain's driver exits 128+N (an error would be a failure)
        raise
    finally:
        stop.uninstall(clean)
        gc.collect()
        rt.shutdown(barrier=not interrupted)
        lock.release()
