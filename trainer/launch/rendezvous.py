"""dtrain's rendezvous: where the stores of a job listen.

c10d stores have no authentication: whoever reaches the port can read and write every key. torch's
TCPStore server listens on every interface whatever host it is given, so dtrain hosts its stores
on sockets it bound itself (TCPStore's `master_listen_fd`): a single-node run on 127.0.0.1 only, a
multi-node run on the rendezvous endpoint's address only (docs/multinode.md, Network exposure).
Both are registered in torch's rendezvous handler registry and picked by `rendezvous_plan`.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

LOOPBACK_BACKEND = "dtrain-loopback"  # the rendezvous of single-node runs
NODES_BACKEND = "dtrain-c10d"  # the rendezvous of multi-node c10d runs
LOOPBACK = "127.0.0.1"


def rendezvous_plan(launch: dict) -> tuple[str, str | None, dict[str, str]]:
    """(rendezvous backend, this node's address to advertise, environment for the workers) of a
    launch: dtrain's own backends for c10d, anything else (etcd, static) as torch has it."""
    if _single_node(launch):
        return LOOPBACK_BACKEND, LOOPBACK, _loopback_env()
    local_addr, env = _node_network(launch)
    backend = NODES_BACKEND if launch["rdzv_backend"] == "c10d" else launch["rdzv_backend"]
    return backend, local_addr, env


def _single_node(launch: dict) -> bool:
    """A one-node c10d job: nobody else has to reach its stores, so they listen on loopback."""
    return launch["nnodes"] == 1 and launch["rdzv_backend"] == "c10d"


def _loopback_env() -> dict[str, str]:
    """gloo binds to the address the hostname resolves to (eth0's on many hosts); on one node the
    workers only talk to each other, so it is pinned to the loopback interface unless the user
    pinned one. (NCCL is left alone: not verified on a GPU here; see docs/multinode.md.)"""
    name = _interface_of(LOOPBACK)
    if not name or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    return {"GLOO_SOCKET_IFNAME": name}


def _node_network(launch: dict) -> tuple[str | None, dict[str, str]]:
    """For multi-node runs: this node's address on the route to the rendezvous host, and the
    workers' GLOO_SOCKET_IFNAME.

    torch advertises `socket.getfqdn()` as the workers' store address by default, and gloo binds
    to whatever the hostname resolves to; on hosts whose name resolves to another interface (or
    to localhost) the other nodes then cannot connect. The address this node uses to reach the
    rendezvous endpoint is one they can reach, so it is advertised instead, and gloo is pointed
    at its interface unless GLOO_SOCKET_IFNAME is already set.
    """
    if launch["nnodes"] <= 1 or launch["rdzv_backend"] != "c10d":
        return None, {}
    host, port = parse_rendezvous_endpoint(launch["rdzv_endpoint"], default_port=29400)
    if host in ("localhost", "127.0.0.1", "::1"):
        return None, {}
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port or 29400, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)  # UDP: picks the route, sends nothing
            local = sock.getsockname()[0]
    except OSError:
        return None, {}
    env = {}
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = _interface_of(local)
        if name and name != "lo":
            env["GLOO_SOCKET_IFNAME"] = name
    return local, env


class _LoopbackRendezvous(RendezvousHandler):
    """The rendezvous of a single-node run: one TCPStore, listening on 127.0.0.1 only.

    c10d stores have no authentication: whoever reaches the port can read and write every key.
    torch's c10d rendezvous hosts two of them (the rendezvous state, and the store the workers
    bootstrap from) and a TCPStore server listens on every interface whatever host it is given
    (both backends, torch 2.13). One node has nobody to meet, so this handler hosts one store on
    a socket it bound to loopback itself (TCPStore's `master_listen_fd`) and hands it to the
    agent, and as MASTER_ADDR/MASTER_PORT to the workers (TORCHELASTIC_USE_AGENT_STORE).
    Only torch's public rendezvous API is used (`RendezvousHandler`, the handler registry).
    """

    def __init__(self, run_id: str, timeout_s: int):
        self._run_id = run_id
        self._round = 0
        self._closed = False
        listener = socket.create_server((LOOPBACK, 0))  # bound and listening
        port = listener.getsockname()[1]
        # The store's server takes the descriptor over (and closes it when it stops).
        self._store: TCPStore | None = TCPStore(
            LOOPBACK, port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach(),
        )
        self._info = RendezvousStoreInfo(master_addr=LOOPBACK, master_port=port)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed or self._store is None:
            raise RendezvousClosedError()
        self._round += 1  # a restart is a new round: the agent's keys start afresh
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{self._round}", self._store)
        return RendezvousInfo(store, rank=0, world_size=1, bootstrap_store_info=self._info)

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store (trainer/process/runtime.py prefixes it per attempt)

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody can join later

    def shutdown(self) -> bool:
        self._closed = True
        self._store = None  # the server stops when the agent lets go of its round's store too
        return True


def _create_loopback_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    return _LoopbackRendezvous(params.run_id, params.get_as_int("timeout", 60))


rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_loopback_rendezvous)


class _NodesRendezvous(RendezvousHandler):
    """The rendezvous of a multi-node c10d run: torch's own (DynamicRendezvousHandler: min/max
    nodes, join and last-call timeouts, heartbeats, a new round per restart), on one store that
    listens on the rendezvous endpoint's address only.

    torch's c10d backend hosts the rendezvous store with `TCPStore(host, port)`, which listens on
    every interface, and the node that gets rank 0 hosts a second store for the workers, on every
    interface too. Here the node that owns the endpoint's address hosts the one store on a socket
    bound to that address (`master_listen_fd`), every other node connects to it, and the workers
    bootstrap from the same store: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (torch's switch) keeps
    torch's handler from starting the second store, and this handler hands the endpoint to the
    agent (use_agent_store: the workers connect as clients; trainer/process/runtime.py prefixes their keys
    per attempt). Only public torch API: the handler registry, `C10dRendezvousBackend`,
    `dynamic_rendezvous.create_handler`, `RendezvousHandler`.
    """

    def __init__(self, inner: RendezvousHandler, store: TCPStore, info: RendezvousStoreInfo):
        self._inner = inner
        self._store = store  # hosted here or a client; lives as long as the handler (other nodes may still use it)
        self._info = info

    def next_rendezvous(self) -> RendezvousInfo:
        with _no_second_store():
            joined = self._inner.next_rendezvous()
        return RendezvousInfo(joined.store, joined.rank, joined.world_size, self._info)

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_backend(self) -> str:
        return NODES_BACKEND

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


_SHARE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_share_lock = threading.Lock()
_share = {"joins": 0, "saved": None}  # joins under way in this process; the switch's value before


@contextmanager
def _no_second_store() -> Iterator[None]:
    """Set torch's switch while any join is under way in this process (joins may overlap: one
    process can hold several handlers), and restore its value after the last."""
    with _share_lock:
        if _share["joins"] == 0:
            _share["saved"] = os.environ.get(_SHARE_SWITCH)
            os.environ[_SHARE_SWITCH] = "1"
        _share["joins"] += 1
    try:
        yield
    finally:
        with _share_lock:
            _share["joins"] -= 1
            if _share["joins"] == 0:
                if _share["saved"] is None:
                    os.environ.pop(_SHARE_SWITCH, None)
                else:
                    os.environ[_SHARE_SWITCH] = _share["saved"]


def _endpoint_listener(host: str, port: int) -> socket.socket | None:
    """A listening socket on the endpoint's address if that address is this node's and its port
    is free; None where another node (or another process here) hosts the store."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, address in addresses:
        try:
            listener = socket.create_server(address, family=family)
            if _is_loopback(address[0]) and host != "localhost" and not _is_loopback(host):
                logging.getLogger(__name__).warning(
                    "launch.rdzv_endpoint %s resolves to %s on this node: the rendezvous store listens "
                    "there only and other machines cannot reach it; give this node's cluster address",
                    host, address[0])
            return listener
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return None  # hosted by another process of this machine: connect to it
    return None


def _is_loopback(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _create_nodes_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    listener = _endpoint_listener(host, port)
    try:
        if listener is not None:
            address, port = listener.getsockname()[:2]
            # The store's server takes the descriptor over (and closes it when it stops).
            store = TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=read_timeout,
                             master_listen_fd=listener.detach())
        else:
            # Wait for the hosting node as long as for the other nodes to join, then read as torch does.
            join = timedelta(seconds=params.get_as_int("join_timeout", 600))
            store = TCPStore(host, port, is_master=False, timeout=join)
            store.set_timeout(read_timeout)
    except (ValueError, RuntimeError, TimeoutError) as err:
        raise RendezvousConnectionError(f"no rendezvous store at {host}:{port}: {err}") from err
    inner = create_dynamic_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    return _NodesRendezvous(inner, store, RendezvousStoreInfo(master_addr=host, master_port=port))


rendezvous_handler_registry.register(NODES_BACKEND, _create_nodes_rendezvous)


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
