"""A dtrain started in the background and the processes around it: start it in its own process
group, wait for a condition or its end, kill it, find its workers and its listening sockets
(read from /proc)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.dtrain import REPO, dtrain_env
from trainer.checkpoint.layout import checkpoint_step, latest_checkpoint
from trainer.process.hang_watch import INJECT_DELAY_ENV

# Rank 0 of a run started here sleeps this long before each step's first batch (the DTRAIN_INJECT_DELAY
# hook), so the signal or kill -9 a test sends once a step is logged lands mid-run on any machine:
# the session corpus's 512-id vocabulary makes a tiny step take milliseconds, less than a poll.
PACE_S = 0.1


def paced(env: dict[str, str]) -> dict[str, str]:
    """`env` with rank 0 sleeping PACE_S before each step."""
    return {**env, INJECT_DELAY_ENV: f"0@*:{PACE_S}"}


def start_dtrain(args: list[str], log: Path) -> subprocess.Popen:
    """dtrain in its own session (process group), so one killpg takes the driver and its workers;
    paced (PACE_S), for a test to interrupt."""
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=paced(dtrain_env()),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if "loss" in record:
                steps.append(record["step"])
    return steps


def past_a_checkpoint(run_dir: Path) -> bool:
    """A complete checkpoint exists and a later step has been logged."""
    ckpt = latest_checkpoint(run_dir)
    steps = logged_steps(run_dir)
    return ckpt is not None and bool(steps) and max(steps) > checkpoint_step(ckpt)


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"dtrain ended (exit code {proc.returncode}) before the condition held:\n"
                                 f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"timed out after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


STOP_LINE = re.compile(r"^dtrain: (SIG\w+) at step (\d+): saved (\S+); exiting with (\d+)$", re.M)


def kill_past_a_checkpoint(args: list[str], run_dir: Path, log: Path) -> int:
    """Start the run `args` and kill -9 its whole process group once a step past a complete
    checkpoint is logged. Returns the last step it logged."""
    proc = start_dtrain(args, log)
    wait_for(lambda: past_a_checkpoint(run_dir), proc, log)
    kill_group(proc)
    return max(logged_steps(run_dir))


def logged(run_dir: Path, at_least: int = 1) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= at_least


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"dtrain did not stop within {timeout} s:\n{log.read_text()[-3000:]}") from None
    return log.read_text()


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def worker_pids(driver: int) -> list[int]:
    """The driver's workers: its spawned children, or its forkserver's children (the launch's
    forkserver is the driver's child; its workers carry its cmdline)."""
    pids = []
    for child in children(driver):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            pids.append(child)
        elif "multiprocessing.forkserver" in cmdline:
            pids.extend(children(child))
    return pids


def wait_for_steps(run_dir, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {steps} steps logged in {timeout} s")


LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (host-order 32-bit words in hex) in text."""
    words = bytes.fromhex(hex_address)
    raw = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening_sockets(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in this pid's network namespace."""
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN:
                address, port = fields[1].rsplit(":", 1)
                found[int(fields[9])] = (_address(address), int(port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def process_tree(root: int) -> list[int]:
    """root and all its descendants (the driver, torch's spawned workers, their helpers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def listeners_of_tree(root: int) -> dict[int, set[tuple[str, int]]]:
    """pid -> the (address, port) its listening TCP sockets are bound to, for the whole tree."""
    table = listening_sockets(root)
    return {pid: {table[inode] for inode in socket_inodes(pid) if inode in table} for pid in process_tree(root)}


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
