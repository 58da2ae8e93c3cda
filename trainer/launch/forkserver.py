"""Workers forked from one process that imported torch once (multiprocessing's forkserver), not each
a fresh interpreter that imports torch, torch._dynamo and dtrain again (spawn).

Every spawned worker paid about 4 CPU-seconds of imports before its first step; docs/performance.md
("How workers start", scripts/bench_launch.py) has the launches' CPU and wall time both ways.

The forkserver is started by the launch, from the thread that starts the workers, and stopped after
it. So it, and every worker it forks, carries this launch's environment (the workers' variables,
dtrain.log's path), signal mask and ignored signals (trainer/launch/relay.py), working folder and
standard streams, as spawned workers did; a sweep's next point gets a fresh one. Its workers are its
children, not the driver's (relay.launched_workers finds them). When the driver dies, the forkserver
sees its pipe close and exits, and the workers get spawn's parent-death signal from it
(trainer/process/signals.py): each worker first closes the copy of that pipe multiprocessing gives
it (release), which would otherwise keep the forkserver, and so the workers, alive.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import forkserver

from trainer.process.collector import resume_collector

# What the forkserver imports first: what every training worker imports before its first step, with
# the garbage collector paused. The entrypoint's module follows per launch, still paused.
PRELOAD = "trainer.launch.preload"

# A process whose cmdline holds this is a forkserver (its forked workers carry the same cmdline).
FORKSERVER_CMDLINE = b"multiprocessing.forkserver"


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


@contextmanager
def forkserver_for(entrypoint: Callable) -> Iterator[None]:
    """A forkserver for one launch of `entrypoint`'s workers: started by the launch's first worker
    (inside the launch's environment and signal mask), stopped when the launch ends."""
    _stop()  # one left by an earlier launch in this process, or data preparation's pool
    multiprocessing.set_forkserver_preload([PRELOAD, entrypoint.__module__])
    try:
        yield
    finally:
        _stop()
        multiprocessing.set_forkserver_preload([])  # a later forkserver in this process is not a launch's


def release() -> None:
    """In a worker, first: the garbage collector on again, with everything imported so far frozen
    (the forkserver's preload paused it; a spawned worker's was on). And in a forked worker, close
    its copy of the driver's end of the forkserver's pipe (multiprocessing hands one to every child,
    so that it can start processes of its own through the same forkserver; a worker that needs one
    starts its own)."""
    resume_collector()
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _stop() -> None:
    # multiprocessing starts its forkserver once per process and has no public way to restart it;
    # _stop closes its pipe (the forkserver exits) and waits for it.
    forkserver._forkserver._stop()
