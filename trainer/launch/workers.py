"""Driver side: start `world` workers through torchrun's own engine (elastic launch)."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.errors import NonFiniteError, Stopped, UserError, WorkerFailed
from trainer.launch import forkserver
from trainer.launch.relay import ELASTIC_SIGNALS, DriverSignals
from trainer.launch.rendezvous import rendezvous_plan
from trainer.launch.worker_errors import (
    leave_with_user_error,
    left_with_user_error,
    raise_injected_error,
    reported_user_error,
)
from trainer.process.env import under_torchrun
from trainer.process.joblog import worker_environment
from trainer.process.streams import survive_closed_readers

# Failures that are one line without a traceback, though not the user's (exit code 1). A worker's
# user error crosses by kind instead (trainer.launch.worker_errors).
ONE_LINE_FAILURES = ("NonFiniteError",)


def run_workers(entrypoint: Callable[..., dict], args: tuple, launch: dict, world: int, log_dir: Path,
                fresh_processes: bool = False, stop_signals: bool = False) -> dict:
    """Run entrypoint(*args) on `world` workers and return rank 0's result (training, `dtrain
    eval` and the benchmarks all start their workers here).

    One worker on one node, or a process that torchrun already started, runs it in this process;
    otherwise torchrun's engine starts world / nnodes workers on this node. `entrypoint` must be a
    module-level function (picklable); `launch` is the config's launch section; the workers other
    than local rank 0 log to files under `log_dir`. The workers fork from one process that imported
    torch once (trainer/launch/forkserver.py) unless `launch.start_method` is spawn.
    `fresh_processes` starts even one worker as a new process, and every worker a fresh interpreter
    (benchmarks measure a process that did nothing else). `stop_signals` (training):
    SIGTERM, SIGINT and SIGUSR1 reach the workers, which save and stop; this process then raises
    Stopped (exit code 128+N) once they are done (trainer.process.signals).
    """
    if under_torchrun() or (world == 1 and launch["nnodes"] == 1 and not fresh_processes):
        return entrypoint(*args)
    nnodes = launch["nnodes"]
    nproc = world // nnodes
    # Local rank 0 prints to this terminal (the progress bar or step lines, also in dtrain.log); the
    # others print their own step lines to files: <log_dir>/<run id>/attempt_<n>/<local rank>/.
    redirects = {local_rank: Std.ALL for local_rank in range(1, nproc)}
    logs = DefaultLogsSpecs(log_dir=str(log_dir), redirects=redirects, tee=Std.NONE)
    rdzv_id = launch["rdzv_id"]
    if nnodes == 1 and rdzv_id == "dtrain":
        rdzv_id = f"dtrain-{uuid.uuid4().hex[:8]}"  # distinct jobs on one host never share a rendezvous
    backend, local_addr, worker_env = rendezvous_plan(launch)
    forked = launch["start_method"] == "forkserver" and forkserver.available() and not fresh_processes
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=rdzv_id,
        rdzv_backend=backend,
        rdzv_endpoint=launch["rdzv_endpoint"],
        rdzv_configs=_rdzv_configs(launch),
        max_restarts=launch["max_restarts"],
        monitor_interval=launch["monitor_interval"],
        start_method="forkserver" if forked else "spawn",
        logs_specs=logs,
        local_addr=local_addr,
        # torch's agent would raise SignalException on SIGTERM/SIGINT and tear the workers down
        **({"signals_to_handle": ELASTIC_SIGNALS} if stop_signals else {}),
    )
    _quiet_user_errors()
    try:
        with _environment({**worker_env, **worker_environment()}), DriverSignals() if stop_signals else nullcontext(), \
                forkserver.forkserver_for(entrypoint) if forked else nullcontext():
            results = elastic_launch(config, worker_process)(entrypoint, *args)
    except ChildFailedError as err:
        # torchelastic's folder of this launch's worker logs (set once the agent has started them)
        line = recorded_line(err, getattr(logs, "_run_log_dir", None))
        if line is not None:
            raise UserError(line) from None
        rank, failure = err.get_first_failure()
        message = _failure_message(failure)
        first = message.split("\n")[0]
        for kind in ONE_LINE_FAILURES:
            if f"{kind}:" in first:
                raise NonFiniteError(first.split(f"{kind}:", 1)[1].strip()) from None
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}):\n{message}") from None
    except Exception as err:  # rendezvous failures surface as several torch exception types
        if type(err).__name__.startswith("Rendezvous") or "rendezvous" in str(err).lower():
            raise UserError(
                f"could not rendezvous at {launch['rdzv_endpoint']} within {launch['rdzv_timeout']} s "
                f"({type(err).__name__}); check launch.rdzv_endpoint and that every node is started"
            ) from None
        raise
    result = results.get(0) if 0 in results else next(iter(results.values()), {})
    if isinstance(result, dict) and result.get("stopped_by"):
        raise Stopped(result["stopped_by"])  # the workers saved and rank 0 said so
    return result


# What gloo and torch say in a worker whose peer's process is gone (its sockets closed under it).
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "remote process exited")
LOST_PEER_WAIT_S = 0.5  # several of the agent's polls (launch.monitor_interval: 0.1 s by default)


def worker_process(entrypoint: Callable[..., dict], *args) -> dict:
    """entrypoint(*args) in a worker process that torchrun's engine started, which exits once it
    returns: its objects are frozen first, so that the interpreter's last garbage collections skip
    them (about 0.3 s of a worker's exit with torch loaded; see trainer.cli.run)."""
    # Python chose stdout's buffering from what the driver's stdout was; the launcher may have
    # pointed it at a log file since: each line goes out as it is printed, not once a block fills.
    sys.stdout.reconfigure(line_buffering=True)
    forkserver.release()  # a spawned worker holds nothing to release
    survive_closed_readers()  # local rank 0 writes to the driver's stdout and stderr: `| head` may close them
    try:
        raise_injected_error()  # a testing hook (trainer.launch.worker_errors)
        return entrypoint(*args)
    except RuntimeError as err:
        if any(words in str(err) for words in LOST_PEER):
            # A peer died (killed, crashed): its exit is the job's failure, this error only its echo.
            # Torch's agent reports one failed worker, the first in rank order at its poll (every
            # launch.monitor_interval); leaving at once can beat the dead peer to it and name this one.
            time.sleep(LOST_PEER_WAIT_S)
        raise
    except Stopped as stop:  # every rank saved and stopped: rank 0's result says so, for the driver
        return {"stopped_by": stop.signum}  # to exit 128+N (an exception would read as a failure)
    except UserError as err:  # any kind of user error: its one line, for the driver
        leave_with_user_error(err)
    finally:
        gc.freeze()


def _rdzv_configs(launch: dict) -> dict:
    return {"timeout": launch["rdzv_timeout"], "join_timeout": launch["rdzv_timeout"]}


@contextmanager
def _environment(updates: dict[str, str]) -> Iterator[None]:
    """Set variables for the workers (they inherit the driver's environment) for one launch only,
    so a later launch in this process (a multirun point, a test) does not inherit them."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _DropUserErrorReports:
    """A logging filter: torchelastic logs every failed worker with its traceback, and torch's
    spawn logs each sibling it terminates after a failure. For a user error (a worker that left
    with one, trainer.launch.worker_errors) or a one-line failure the driver prints one line instead, so
    those reports are dropped (a crash keeps its traceback)."""

    def filter(self, record) -> bool:
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            if left_with_user_error(getattr(exc, "exit_code", None)):
                return False
            text += str(exc)
        if text.startswith("Terminating process") and "via signal" in text:
            return False
        return not any(f"trainer.errors.{kind}:" in text for kind in ONE_LINE_FAILURES)


def _quiet_user_errors() -> None:
    names = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUserErrorReports) for f in logger.filters):
            logger.addFilter(_DropUserErrorReports())


ERROR_FILE_NAME = "error.json"  # each worker's TORCHELASTIC_ERROR_FILE, as torchelastic names it


def recorded_line(err: ChildFailedError, run_log_dir: str | None) -> str | None:
    """The one line a worker of this host recorded (trainer/process/error_record.py), whichever worker
    failed first. A hang's reporting rank records its line and then ends the frozen rank (-9): the
    agent may see that death, and stop, before the reporting rank has exited and is among the
    failures. So every local worker's error file of the last attempt is read too
    (torchelastic's <run log dir>/attempt_<n>/<local rank>/error.json)."""
    for _, failure in sorted(err.failures.items()):
        line = reported_user_error(failure.error_file_data)
        if line is not None:
            return line
    attempts = sorted(Path(run_log_dir).glob("attempt_*"), key=lambda p: int(p.name.split("_")[1])) \
        if run_log_dir else []
    for path in sorted(attempts[-1].glob(f"*/{ERROR_FILE_NAME}")) if attempts else []:
        try:
            line = reported_user_error(json.loads(path.read_text()))
        except (OSError, ValueError):  # a file being written, or not a record
            continue
        if line is not None:
            return line
    return None


def _failure_message(failure) -> str:
    """The worker's exception text from torchelastic's error file, with its traceback."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("message", "")
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        return f"{text}\n{stack}".strip() if stack and stack not in text else text
    if not message and failure.error_file and os.path.exists(failure.error_file):
        try:
            return json.loads(Path(failure.error_file).read_text())["message"]["message"]
        except (OSError, KeyError, ValueError):
            pass
    return str(message or f"exit code {failure.exitcode}; see {failure.error_file or 'the worker logs'}")
