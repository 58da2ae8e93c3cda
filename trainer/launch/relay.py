"""The driver's side of stop signals, around torchrun's engine (trainer/process/signals.py tells the
whole story): torch's elastic agent would turn SIGTERM/SIGINT into SignalException and tear the
workers down within seconds, so its handlers are kept off these signals; the driver relays the
first signal to its workers (as SIGRTMIN+N) and waits for them to save, and a second one kills them
and exits at once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

from trainer.launch.forkserver import FORKSERVER_CMDLINE
from trainer.process.signals import (
    RELAY_ENV,
    RELAY_PERIOD_S,
    STOP_SIGNALS,
    announcement,
    relay_of,
    say_now,
    signal_name,
)

# What torch's agent may still turn into SignalException (LaunchConfig.signals_to_handle; its default
# adds SIGTERM and SIGINT): the stop signals are DriverSignals' to handle.
ELASTIC_SIGNALS = "SIGHUP,SIGQUIT"
WAIT_POLL_S = 0.2  # how often the driver's signal thread looks whether the launch ended


def launched_workers(parent: int) -> list[int]:
    """The pids of the workers torchrun's engine started for `parent`: its spawned children, or the
    children of its forkserver (trainer/launch/forkserver.py)."""
    processes = list(_processes())
    children = [(pid, cmdline) for pid, ppid, cmdline in processes if ppid == parent]
    forkservers = {pid for pid, cmdline in children if FORKSERVER_CMDLINE in cmdline}
    return [pid for pid, cmdline in children if b"spawn_main" in cmdline] + \
        [pid for pid, ppid, _ in processes if ppid in forkservers]


def _processes() -> Iterator[tuple[int, int, bytes]]:
    """(pid, parent pid, cmdline) of every process (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            yield int(entry.name), ppid, (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


class DriverSignals:
    """The driver's handlers while torchrun's engine runs the workers of a training run."""

    def __init__(self):
        self.signum = 0
        self.done = threading.Event()
        self.previous: dict[int, object] = {}
        self.previous_mask: set[int] | None = None
        self.waiter: threading.Thread | None = None
        self.saved_env: dict[str, str | None] = {}

    def __enter__(self) -> DriverSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._set_env(RELAY_ENV, "1")  # inherited by the workers
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)  # for a thread that was up before
            # Ignored here and so in every worker until its own handler is up (an ignored
            # disposition survives exec): a relay that comes too early is sent again.
            self.previous[relay_of(sig)] = signal.signal(relay_of(sig), signal.SIG_IGN)
        # Blocked in this thread, which starts the workers, and so in them until their handlers are
        # up (a blocked signal stays blocked across exec, then pending): a signal to the whole process
        # group while a worker still imports torch would otherwise kill it (SIGTERM, SIGUSR1) before it
        # can save. The same holds for multiprocessing's resource tracker, started here first (it
        # ignores only SIGINT and SIGTERM: a group SIGUSR1 killed it, and the one relaunched printed a
        # KeyError traceback for each semaphore released). This process takes them in a thread of
        # its own (threads started from here on inherit the block).
        self.previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        resource_tracker.ensure_running()  # a no-op when it runs already (an earlier sweep point's)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the tracker's start unblocks SIGINT and SIGTERM
        self.waiter = threading.Thread(target=self._wait_for_signals, name="dtrain-signal-wait", daemon=True)
        self.waiter.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.waiter is not None:
            self.waiter.join()
            self.waiter = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        if self.previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
            self.previous_mask = None
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _set_env(self, key: str, value: str) -> None:
        self.saved_env[key] = os.environ.get(key)
        os.environ[key] = value

    def _wait_for_signals(self) -> None:
        while not self.done.is_set():
            info = signal.sigtimedwait(STOP_SIGNALS, WAIT_POLL_S)
            if info is not None:
                self._handle(info.si_signo, None)

    def _handle(self, signum, _frame) -> None:
        if not self.signum:
            self.signum = signum
            say_now(announcement(signum))
            threading.Thread(target=self._relay, name="dtrain-signal-relay", daemon=True).start()
            return
        for pid in launched_workers(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        say_now(f"second signal ({signal_name(signum)}): stopped the workers without saving; "
                f"exiting with {128 + signum}")
        os._exit(128 + signum)

    def _relay(self) -> None:
        # Until the workers are done: one that was still starting (or a restarted one) gets it too.
        while not self.done.is_set():
            for pid in launched_workers(os.getpid()):
                try:
                    os.kill(pid, relay_of(self.signum))
                except ProcessLookupError:
                    pass
            self.done.wait(RELAY_PERIOD_S)
