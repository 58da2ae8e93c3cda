"""What a single-node distributed run exposes to the network: c10d stores have no authentication,
so every socket a `dtrain train parallel=ddp world=2` run listens on (the driver's store, the
workers' gloo listeners) must be bound to a loopback address, none to 0.0.0.0 or ::.

Read from the kernel's own tables (/proc/<pid>/net/tcp{,6} and the processes' fd links) while a
real run trains; nothing is mocked."""

from __future__ import annotations

import gc
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers.dtrain import tiny_args
from helpers.processes import (
    is_loopback,
    listeners_of_tree,
    listening_sockets,
    logged_steps,
    socket_inodes,
    start_dtrain,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from trainer.launch.rendezvous import LOOPBACK_BACKEND, NODES_BACKEND


def test_single_node_run_listens_on_loopback_only(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    # Long enough to sample while it trains; the run is stopped once two steps are logged.
    proc = start_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=400"), log)
    seen: dict[int, set[tuple[str, int]]] = {}
    try:
        deadline = time.monotonic() + 240
        # Sampled over and over from launch to the 2nd step: listeners that come and go count too.
        while len(logged_steps(run_dir)) < 2:
            assert proc.poll() is None, f"dtrain ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no training steps after 240 s:\n{log.read_text()[-3000:]}"
            for pid, bound in listeners_of_tree(proc.pid).items():
                seen.setdefault(pid, set()).update(bound)
            time.sleep(0.2)  # a sample reads /proc for ~30 ms: leave the cores to the run
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    report = "\n".join(f"pid {pid}: {sorted(bound)}" for pid, bound in sorted(seen.items()))
    print(report)
    listening = {pid: bound for pid, bound in seen.items() if bound}
    # The driver hosts the store; each of the two workers has its gloo listener.
    assert proc.pid in listening, f"the driver listened on nothing:\n{report}"
    assert len(listening) >= 3, f"expected the driver and two workers to listen:\n{report}"
    exposed = {pid: sorted(a for a in bound if not is_loopback(a[0])) for pid, bound in listening.items()}
    assert not any(exposed.values()), f"sockets reachable from other hosts: {exposed}\n{report}"


def test_loopback_rendezvous_serves_rounds_on_loopback_only():
    """The single-node rendezvous through torch's registry, as the elastic agent uses it: a store
    on 127.0.0.1 that workers reach, fresh keys for every round (a restart), closed at shutdown."""
    params = RendezvousParameters(backend=LOOPBACK_BACKEND, endpoint="localhost:0", run_id="net-test",
                                  min_nodes=1, max_nodes=1, timeout=5)
    handler = rendezvous_handler_registry.create_handler(params)
    first, second = handler.next_rendezvous(), handler.next_rendezvous()
    info = first.bootstrap_store_info
    assert (first.rank, first.world_size, info.master_addr) == (0, 1, "127.0.0.1")
    assert second.bootstrap_store_info == info  # restarted workers find the same store
    table = listening_sockets(os.getpid())
    own = [table[inode] for inode in socket_inodes(os.getpid()) if inode in table]
    assert [bound for bound in own if bound[1] == info.master_port] == [("127.0.0.1", info.master_port)]
    worker = dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timedelta(seconds=5))
    worker.set("k", "v")
    first.store.set("round", "1")
    assert not second.store.check(["round"])  # each round's keys apart
    assert handler.use_agent_store and handler.num_nodes_waiting() == 0
    assert handler.shutdown() and handler.is_closed()
    with pytest.raises(RendezvousClosedError):
        handler.next_rendezvous()
    del first, second, worker  # the agent lets go of its rounds' stores: the server stops
    gc.collect()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", info.master_port), timeout=5).close()


def test_nodes_rendezvous_hosts_one_store_on_the_endpoint_address():
    """The multi-node rendezvous through torch's registry, two nodes in one process: the first
    binds the endpoint's address and hosts the store there (no wildcard listener, no second store
    for the workers), the second connects to it; both join one round and hand the endpoint to
    their workers."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    params = RendezvousParameters(backend=NODES_BACKEND, endpoint=f"127.0.0.1:{port}", run_id="nodes-test",
                                  min_nodes=2, max_nodes=2, join_timeout=60, last_call_timeout=1)
    host = rendezvous_handler_registry.create_handler(params)
    other = rendezvous_handler_registry.create_handler(params)
    with ThreadPoolExecutor(2) as pool:
        joined = list(pool.map(lambda handler: handler.next_rendezvous(), (host, other)))
    assert sorted(info.rank for info in joined) == [0, 1] and {info.world_size for info in joined} == {2}
    assert {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in joined} == {
        ("127.0.0.1", port)}
    assert host.use_agent_store and other.use_agent_store
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ  # set for torch's handler only
    table = listening_sockets(os.getpid())
    own = [table[inode] for inode in socket_inodes(os.getpid()) if inode in table]
    assert [bound for bound in own if bound[1] == port] == [("127.0.0.1", port)], own
    assert all(is_loopback(address) for address, _ in own), own  # torch's second store is not started
    worker = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    worker.set("k", "v")
    assert worker.get("k") == b"v"
    assert host.num_nodes_waiting() == 0
    assert host.shutdown() and other.shutdown()
