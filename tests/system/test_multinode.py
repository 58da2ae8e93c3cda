"""Two nodes through a c10d rendezvous: two network namespaces joined by a veth pair on this machine
(10.77.0.1 and 10.77.0.2, the test's own hosts; nothing else is contacted), one `dtrain train
launch.nnodes=2` per namespace, one worker each. The job must match a single-node world=2 run.

And HSDP's default layout, one replica per node: two agents on this machine's loopback (no root
needed) under parallel=hsdp, whose dp_replicate defaults to launch.nnodes, track one process."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers.checkpoints import loss_records
from helpers.dtrain import REPO, dtrain_env, tiny_args, train_losses
from helpers.processes import finish, is_loopback, listeners_of_tree, start_dtrain, worker_pids
from helpers.runs import (
    CKPT_ARGS,
    CKPT_NAMES,
    REFERENCE_BATCH,
    REFERENCE_STEPS,
    assert_matches_one_process,
    checkpointed,
)

HOST_A, HOST_B = "10.77.0.1", "10.77.0.2"
PORT = 29500  # a fresh namespace has nothing listening


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces (name, interface) linked by a veth pair; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip"):
        pytest.skip("the `ip` command is missing (apt-get install iproute2)")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b, if_a, if_b = f"dtrainA{tag}", f"dtrainB{tag}", f"dtva{tag}", f"dtvb{tag}"
    steps = [
        ("netns", "add", ns_a), ("netns", "add", ns_b),
        ("link", "add", if_a, "type", "veth", "peer", "name", if_b),
        ("link", "set", if_a, "netns", ns_a), ("link", "set", if_b, "netns", ns_b),
        ("-n", ns_a, "addr", "add", f"{HOST_A}/24", "dev", if_a),
        ("-n", ns_b, "addr", "add", f"{HOST_B}/24", "dev", if_b),
        ("-n", ns_a, "link", "set", "lo", "up"), ("-n", ns_b, "link", "set", "lo", "up"),
        ("-n", ns_a, "link", "set", if_a, "up"), ("-n", ns_b, "link", "set", if_b, "up"),
    ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                reason = f"cannot build network namespaces here (ip {' '.join(step)}: {done.stderr.strip()})"
                print(reason)
                pytest.skip(reason)
        yield (ns_a, if_a), (ns_b, if_b)
    finally:
        _ip("netns", "del", ns_a)
        _ip("netns", "del", ns_b)
        _ip("link", "del", if_a)


@pytest.mark.slow
def test_two_nodes_match_one_node(two_hosts, data_dir, references, tmp_path):
    reference = references("ddp")
    procs = []
    try:
        for index, (namespace, _) in enumerate(two_hosts):
            run_dir = tmp_path / f"node{index}"
            # One worker per node, one thread each: the same arithmetic as the reference's two
            # local workers. No GLOO_SOCKET_IFNAME or MASTER_ADDR: dtrain finds the veth itself.
            args = tiny_args(data_dir, run_dir, *CKPT_ARGS, *checkpointed("ddp"), "launch.nnodes=2",
                             f"launch.rdzv_endpoint={HOST_A}:{PORT}", "launch.rdzv_timeout=120",
                             "launch.timeout_s=120", "launch.threads_per_worker=1")
            log = (tmp_path / f"node{index}.log").open("w")
            command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "trainer", *args]
            procs.append(subprocess.Popen(command, cwd=REPO, env=dtrain_env(), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        # Every listening socket of both nodes' process trees (drivers, workers), sampled from the
        # namespaces' own tables until the job ends: listeners that come and go count too.
        seen: list[dict[int, set[tuple[str, int]]]] = [{}, {}]
        deadline = time.monotonic() + 600
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            for index, proc in enumerate(procs):
                if proc.poll() is None:
                    for pid, bound in listeners_of_tree(proc.pid).items():
                        seen[index].setdefault(pid, set()).update(bound)
            time.sleep(0.3)
        codes = [proc.wait(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n----\n".join(text[-3000:] for text in logs)
    # Each node listens on its own address toward the rendezvous host (the rendezvous store on
    # HOST_A:PORT, gloo), or on loopback; never on a wildcard address that every interface reaches.
    report = "\n".join(f"node {HOST_A if i == 0 else HOST_B} pid {pid}: {sorted(bound)}"
                       for i, node in enumerate(seen) for pid, bound in sorted(node.items()) if bound)
    print(report)
    for own, node in zip((HOST_A, HOST_B), seen):
        stray = sorted({a for bound in node.values() for a in bound if a[0] != own and not is_loopback(a[0])})
        assert not stray, f"node {own} listened beyond its own address: {stray}\n{report}"
    assert (HOST_A, PORT) in set().union(*seen[0].values()), f"no rendezvous store on {HOST_A}:{PORT}\n{report}"
    assert sum(1 for node in seen for bound in node.values() if bound) >= 3, report  # a store, two gloo
    # Global rank 0 is the only writer of metrics and checkpoints (the rendezvous orders nodes
    # by process id, so it may live on either node).
    writers = [tmp_path / f"node{i}" for i in range(2) if (tmp_path / f"node{i}" / "metrics.jsonl").exists()]
    assert len(writers) == 1, writers
    head = writers[0]
    other = tmp_path / ("node1" if head.name == "node0" else "node0")
    assert not (other / "checkpoints").exists()
    names = sorted(p.name for p in (head / "checkpoints").iterdir())
    assert names == CKPT_NAMES
    got, want = loss_records(head), loss_records(reference)
    assert [r[0] for r in got] == [r[0] for r in want]
    assert max(abs(a[1] - b[1]) for a, b in zip(got, want)) <= 1e-6, (got, want)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_hsdp_on_two_agents_puts_one_replica_on_each_node(data_dir, adamw_reference, tmp_path):
    """Two `dtrain train launch.nnodes=2` agents on one rendezvous endpoint, one worker each: HSDP's
    mesh is dp_replicate 2 (the default, launch.nnodes) x dp_shard 1, so global ranks 0 and 1, the two
    replicas, must be on different agents; the losses track one process on the same 256-token steps."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents, logs = [], []
    try:
        for index in range(2):
            args = tiny_args(data_dir, tmp_path / f"node{index}", *REFERENCE_BATCH, "parallel=hsdp", "world=2",
                             "train.micro_batch_size=2", "launch.nnodes=2", f"launch.rdzv_endpoint={endpoint}",
                             "launch.rdzv_timeout=120", "launch.timeout_s=120")
            logs.append(tmp_path / f"node{index}.log")
            agents.append(start_dtrain(args, logs[-1]))
        # each agent's worker processes, read while they run
        workers: list[set[int]] = [set(), set()]
        deadline = time.monotonic() + 300
        while any(agent.poll() is None for agent in agents) and time.monotonic() < deadline:
            for seen, agent in zip(workers, agents):
                seen.update(worker_pids(agent.pid))
            time.sleep(0.2)
        texts = [finish(agent, log) for agent, log in zip(agents, logs)]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert [agent.returncode for agent in agents] == [0, 0], "\n----\n".join(t[-3000:] for t in texts)
    assert [len(seen) for seen in workers] == [1, 1], workers  # one worker per node
    # Global rank 0 prints the start line with the mesh; rank 1 prints its pid: one on each agent.
    head = [i for i, text in enumerate(texts) if "parallel=hsdp (dp_replicate 2) world=2" in text]
    other = [i for i, text in enumerate(texts) if any(f"rank 1: pid {pid} on" in text for pid in workers[i])]
    assert len(head) == 1 and len(other) == 1 and head != other, (head, other, workers, texts)
    assert "rank 1:" not in texts[head[0]]
    run_dir = tmp_path / f"node{head[0]}"
    assert_matches_one_process(adamw_reference, train_losses(run_dir), REFERENCE_STEPS, "hsdp over two agents")
