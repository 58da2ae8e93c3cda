"""Driver side: start `world` workers through torchrun's own engine (elastic launch)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import struct
import uuid
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.env import under_torchrun
from trainer.errors import NonFiniteError, UserError, WorkerFailed

USER_ERROR_TYPES = ("UserError", "ConfigError", "DataError", "CheckpointError")
# Failures that are one line without a traceback, though not the user's (exit code 1).
ONE_LINE_FAILURES = ("NonFiniteError",)


def run_workers(entrypoint: Callable[..., dict], args: tuple, launch: dict, world: int, log_dir: Path,
                fresh_processes: bool = False) -> dict:
    """Run entrypoint(*args) on `world` workers and return rank 0's result (training, `dtrain
    eval` and the benchmarks all start their workers here).

    One worker on one node, or a process that torchrun already started, runs it in this process;
    otherwise torchrun's engine starts world / nnodes workers on this node. `entrypoint` must be a
    module-level function (picklable); `launch` is the config's launch section; the workers other
    than local rank 0 log to files under `log_dir`. `fresh_processes` starts even one worker as a
    new process (benchmarks measure a process that did nothing else).
    """
    if under_torchrun() or (world == 1 and launch["nnodes"] == 1 and not fresh_processes):
        return entrypoint(*args)
    nnodes = launch["nnodes"]
    nproc = world // nnodes
    # Local rank 0 prints to this terminal (the rich progress bar); the others log to files.
    redirects = {local_rank: Std.ALL for local_rank in range(1, nproc)}
    logs = DefaultLogsSpecs(log_dir=str(log_dir), redirects=redirects, tee=Std.NONE)
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
        rdzv_configs=_rdzv_configs(launch),
        max_restarts=launch["max_restarts"],
        monitor_interval=launch["monitor_interval"],
        start_method="spawn",
        logs_specs=logs,
        local_addr=_node_network(launch),
    )
    _quiet_user_errors()
    try:
        results = elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = _failure_message(failure)
        first = message.split("\n")[0]
        if any(message.startswith(kind + ":") or f".{kind}:" in first for kind in USER_ERROR_TYPES):
            raise UserError(message.split(":", 1)[1].strip().split("\n")[0]) from None
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
    return results.get(0) if 0 in results else next(iter(results.values()), {})


def _rdzv_configs(launch: dict) -> dict:
    configs = {"timeout": launch["rdzv_timeout"], "join_timeout": launch["rdzv_timeout"]}
    if launch["nnodes"] > 1 and launch["rdzv_backend"] == "c10d" and _hosts_endpoint(launch["rdzv_endpoint"]):
        # torch decides who hosts the c10d store by comparing the endpoint with this machine's
        # hostname; a node whose address is on a secondary interface (a cluster network, a
        # container's veth) would then host nothing and every node would wait for a server.
        configs["is_host"] = True
    return configs


def _hosts_endpoint(endpoint: str) -> bool:
    """Whether the rendezvous endpoint is an address of this machine whose port is free here."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    if _matches_machine_hostname(host):
        return False  # torch's own check already finds it (and falls back if the port is taken)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        return True
    except OSError:
        return False


def _node_network(launch: dict) -> str | None:
    """For multi-node runs: this node's address on the route to the rendezvous host.

    torch advertises `socket.getfqdn()` as the workers' store address by default, and gloo binds
    to whatever the hostname resolves to; on hosts whose name resolves to another interface (or
    to localhost) the other nodes then cannot connect. The address this node uses to reach the
    rendezvous endpoint is one they can reach, so it is advertised instead, and gloo is pointed
    at its interface unless GLOO_SOCKET_IFNAME is already set.
    """
    if launch["nnodes"] <= 1 or launch["rdzv_backend"] != "c10d":
        return None
    host, port = parse_rendezvous_endpoint(launch["rdzv_endpoint"], default_port=29400)
    if host in ("localhost", "127.0.0.1", "::1"):
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port or 29400, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)  # UDP: picks the route, sends nothing
            local = sock.getsockname()[0]
    except OSError:
        return None
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = _interface_of(local)
        if name and name != "lo":
            os.environ["GLOO_SOCKET_IFNAME"] = name  # inherited by the workers
    return local


def _interface_of(address: str) -> str | None:
    """The network interface holding an IPv4 address (Linux), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for name in names:
                try:
                    request = struct.pack("256s", name.encode()[:15])
                    packed = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == address:
                    return name
    except (OSError, ValueError):
        pass
    return None


class _DropUserErrorReports:
    """A logging filter: torchelastic logs every failed worker with its traceback, and torch's
    spawn logs each sibling it terminates after a failure. For a user error the driver prints one
    line instead, so those reports are dropped (a crash keeps its traceback)."""

    def filter(self, record) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        if text.startswith("Terminating process") and "via signal" in text:
            return False
        return not any(f"trainer.errors.{kind}:" in text for kind in USER_ERROR_TYPES + ONE_LINE_FAILURES)


def _quiet_user_errors() -> None:
    names = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUserErrorReports) for f in logger.filters):
            logger.addFilter(_DropUserErrorReports())


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
