"""Driver side: start `world` workers through torchrun's own engine (elastic launch)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.errors import UserError
from trainer.worker import worker_main

USER_ERROR_TYPES = ("UserError", "ConfigError", "DataError", "CheckpointError")


class WorkerFailed(Exception):
    """A worker died for a reason that is not the user's input; carries its error report."""


def launch_workers(cfg_dict: dict, run_dir: Path, world: int) -> dict:
    """Run worker_main on `world` workers (world / nnodes on this node); return rank 0's result."""
    launch = cfg_dict["launch"]
    nnodes = launch["nnodes"]
    nproc = world // nnodes
    # Local rank 0 prints to this terminal (the rich progress bar); the others log to files.
    redirects = {local_rank: Std.ALL for local_rank in range(1, nproc)}
    logs = DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=redirects, tee=Std.NONE)
    rdzv_id = launch["rdzv_id"]
    if nnodes == 1 and rdzv_id == "dtrain":
        rdzv_id = f"dtrain-{uuid.uuid4().hex[:8]}"  # distinct jobs on one host never share a rendezvous
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=rdzv_id,
        rdzv_backend=launch["rdzv_backend"],
        rdzv_endpoint=launch["rdzv_endpoint"],
        rdzv_configs={"timeout": launch["rdzv_timeout"], "join_timeout": launch["rdzv_timeout"]},
        max_restarts=launch["max_restarts"],
        monitor_interval=launch["monitor_interval"],
        start_method="spawn",
        logs_specs=logs,
    )
    try:
        results = elastic_launch(config, worker_main)(cfg_dict, str(run_dir))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = _failure_message(failure)
        if any(message.startswith(kind + ":") or f".{kind}:" in message.split("\n")[0] for kind in USER_ERROR_TYPES):
            raise UserError(message.split(":", 1)[1].strip().split("\n")[0]) from None
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}):\n{message}") from None
    except Exception as err:  # rendezvous failures surface as several torch exception types
        if type(err).__name__.startswith("Rendezvous") or "rendezvous" in str(err).lower():
            raise UserError(
                f"could not rendezvous at {launch['rdzv_endpoint']} within {launch['rdzv_timeout']} s "
                f"({type(err).__name__}); check launch.rdzv_endpoint and that every node is started"
            ) from None
        raise
    return results.get(0) if 0 in results else next(iter(results.values()), {})


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
