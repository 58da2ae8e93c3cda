"""Stop signals: SIGTERM, SIGINT or SIGUSR1 (Slurm's `--signal=B:USR1@120`) saves and exits 128+N.

Worker side (every rank; also a one-process run, where the worker is the driver): the handler only
records the signal. At each optimizer-step boundary the loop calls `at_step_boundary`: the ranks
agree on the largest signal number any of them recorded (a MAX all-reduce), save a checkpoint, rank
0 prints one line, and every rank raises `Stopped` (exit code 128+N). The all-reduce is asynchronous
on a gloo group of its own and is read one boundary later, so a step never waits for it (no host
sync on the accelerator either): a signal is acted on at most one step late, by all ranks at the
same step. A second signal exits at once, without saving.

Driver side (`DriverSignals` in trainer/launch/relay.py, around torchrun's engine): torch's elastic agent
would turn SIGTERM/SIGINT into SignalException and tear the workers down within seconds, so its
handlers are kept off these signals; the driver relays the first signal to its workers and waits
for them to save, and a second one kills them and exits at once. The relay is SIGRTMIN+N, not N
itself: a signal sent to the whole process group already reaches every worker, and a worker must
not count the driver's copy as the second signal. The workers start with the stop signals blocked
and unblock them once their handlers are up, so a signal to the whole process group (Slurm's
--signal and scancel -s, Kubernetes) while they still start is acted on as one to the driver
(the driver takes them in a thread of its own meanwhile). Workers also exit on their own when the driver
dies (kill -9): torch's spawn sends them SIGINT then, which the handler recognises by the changed
parent pid or the launcher seen dying (zombie, SIGKILL pending), says so in one line and exits
without claiming a save; a watchdog thread covers a main thread stuck inside a collective. The
first signal is announced at once only by the process that received it from the user (dtrain's
driver, or a one-process run); a launcher's worker speaks at the step boundary, when it saved.

A stop signal while a worker's process group still comes up cannot run its Python handler: the main
thread waits inside torch's store for peers. A watcher thread sees it through the wakeup fd. When the
driver does not relay it (plain torchrun never does), it is the launcher tearing the job down because
a peer failed (or the user stopping a job that has made no step): the peer will never join, so the
worker exits at once and silently (128+N; nothing to save yet) instead of waiting out the launcher's
30 s before its SIGKILL; the peer's failure is what the driver reports. Only a signal the launcher
tears down with counts: torch's agent sends its workers SIGTERM, or under plain torchrun the SIGINT or
SIGTERM it got itself; never SIGUSR1 (it does not handle it), and under dtrain's driver, which keeps
the agent's handlers off the stop signals, never SIGINT. Those are always a user's stop, saved at the
first step however late the relay comes on a loaded machine.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.errors import Stopped
from trainer.process.env import continue_command, under_torchrun
from trainer.process.joblog import say

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
RELAY_ENV = "DTRAIN_SIGNAL_RELAY"  # set by dtrain's driver: it relays stop signals and reports a second one
PARENT_POLL_S = 0.5
# How long a worker's SIGINT waits to see whether its launcher is dying (kill -9) before it counts
# as a stop request; a real stop is acted on at the next step boundary anyway.
DEATH_GRACE_S = 0.3
RELAY_PERIOD_S = 1.0  # how often dtrain's driver sends its relay again until the workers are done
# How long a worker whose process group is still coming up waits for the relay of a stop signal it got
# directly before it takes the signal for the launcher's teardown: several relay periods, so that a
# loaded machine does not turn a user's stop at startup (saved at the first step) into an exit.
RELAY_GRACE_S = 5 * RELAY_PERIOD_S

_active: StopSignals | None = None


def proc_status(pid: int) -> dict[str, str] | None:
    """The fields of /proc/PID/status (None: the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return {key: value.strip() for key, value in (line.split(":", 1) for line in status.splitlines() if ":" in line)}


def signal_pending(fields: dict[str, str], sig: int) -> bool:
    """`sig` is pending on the process whose status `fields` are (on it or on one of its threads)."""
    return any(int(fields.get(name) or "0", 16) & (1 << (sig - 1)) for name in ("SigPnd", "ShdPnd"))


def _dying(pid: int) -> bool:
    """Process `pid` is gone, a zombie, or has a SIGKILL pending (a kill -9 that its threads are
    still acting on)."""
    fields = proc_status(pid)
    if fields is None or fields.get("State", "")[:1] in ("Z", "X"):
        return True
    return signal_pending(fields, signal.SIGKILL)


def relay_of(signum: int) -> int:
    """The real-time signal that carries stop signal `signum` from the driver to its workers."""
    return signal.SIGRTMIN + signum


def say_now(text: str) -> None:
    # os.write: a handler may interrupt a print on the same stream (a reentrant call would raise)
    try:
        os.write(sys.stderr.fileno(), f"dtrain: {text}\n".encode())
    except (OSError, ValueError):
        pass


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def announcement(signum: int) -> str:
    return (f"{signal_name(signum)} received: saving a checkpoint at the end of this step "
            "(a second signal stops at once)")


class StopSignals:
    """A worker's stop-signal handlers and its side of the step-boundary agreement."""

    def __init__(self, rank: int):
        self.rank = rank
        self.signum = 0  # the first stop signal this process received (0: none)
        self.relayed_by_driver = os.environ.get(RELAY_ENV) == "1"
        # What a launcher tears its workers down with (see the module's docstring).
        self.teardown_signals = {signal.SIGTERM} if self.relayed_by_driver else {signal.SIGTERM, signal.SIGINT}
        # A launcher's worker (torchrun or dtrain's driver) dies with its launcher.
        self.parent = os.getppid() if under_torchrun() else None
        self.previous: dict[int, object] = {}
        self.group = None
        self.pending = None  # (work, tensor) of the all-reduce issued at the previous boundary
        self.group_up = threading.Event()
        self.wakeup: int | None = None  # while watched: the wakeup fd the watcher's pipe replaced

    def install(self) -> StopSignals:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._direct)
            self.previous[relay_of(sig)] = signal.signal(relay_of(sig), self._relayed)
        if self.parent is not None:
            self._watch_bring_up()
        # dtrain's driver starts its workers with the stop signals blocked (DriverSignals): one
        # that reached this process meanwhile is pending and lands in the handler now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        if self.parent is not None:
            threading.Thread(target=self._watch_parent, name="dtrain-parent-watchdog", daemon=True).start()
        _active = self
        return self

    def uninstall(self, clean: bool) -> None:
        """Restore the previous handlers; `clean`: every rank left the loop together, so the
        all-reduce still in flight completes and is waited for (not after a failure: a dead peer)."""
        global _active
        self.process_group_up()
        if clean and self.pending is not None:
            self.pending[0].wait()
        self.pending = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        if _active is self:
            _active = None

    # --- while the process group comes up ---
    def _watch_bring_up(self) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C handler must never block on it
        replaced = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self.wakeup = replaced
        threading.Thread(target=self._teardown_watch, args=(read_end,), name="dtrain-bring-up-watch",
                         daemon=True).start()

    def process_group_up(self) -> None:
        """The process group is up (or will never be): from here a stop signal is acted on at the
        step boundary, where every rank agrees on it."""
        self.group_up.set()
        if self.wakeup is not None:
            replaced = self.wakeup
            self.wakeup = None
            os.close(signal.set_wakeup_fd(replaced))  # the watcher sees EOF and closes its end

    def _teardown_watch(self, read_end: int) -> None:
        """Reads the signals' wakeup bytes until process_group_up closes the pipe's write end (EOF),
        so that no signal meanwhile writes into a pipe nobody reads."""
        relays = {relay_of(sig) for sig in STOP_SIGNALS}
        direct, relayed, deadline = 0, False, 0.0
        try:
            while True:
                waiting = direct and not relayed
                wait = min(PARENT_POLL_S, max(0.0, deadline - time.monotonic())) if waiting else PARENT_POLL_S
                if select.select([read_end], [], [], wait)[0]:
                    received = os.read(read_end, 64)
                    if not received:
                        return  # the process group is up
                    relayed = relayed or bool(relays.intersection(received))  # a stop: saved at the first step
                    if not direct:
                        direct = next((sig for sig in received if sig in self.teardown_signals), 0)
                        deadline = time.monotonic() + RELAY_GRACE_S
                if direct and not relayed and time.monotonic() >= deadline and not self.group_up.is_set():
                    os._exit(128 + direct)  # the launcher's teardown: a peer failed, none will join
        finally:
            os.close(read_end)

    # --- handlers: record only; the loop acts at the step boundary ---
    def _orphaned(self) -> bool:
        return self.parent is not None and os.getppid() != self.parent

    def _driver_died(self, signum: int) -> bool:
        """This signal is spawn's parent-death SIGINT: the launcher is dead or dying. The kernel
        sends it when the thread that started this worker exits, which in a kill -9 can come before
        the launcher's last thread is gone (getppid() still names it then): so a SIGINT under a
        launcher waits briefly for the launcher to be seen dying before it counts as a stop request."""
        if self.parent is None:
            return False
        if signum != signal.SIGINT:
            return self._orphaned()
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            if self._orphaned() or _dying(self.parent):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def _exit_orphaned(self, signum: int) -> None:
        say_now(f"rank {self.rank}: the launcher (pid {self.parent}) died; exiting without saving (the same "
             "command continues from the newest checkpoint)")
        os._exit(128 + signum)  # nobody waits for this worker any more

    def _direct(self, signum, _frame) -> None:
        first = not self.signum  # before the wait below: the driver's relay of this very signal may land in it
        if self._driver_died(signum):
            self._exit_orphaned(signum)
        if first:
            if not self.signum:
                self._first(signum)
            return
        if self.rank == 0 and not self.relayed_by_driver:  # dtrain's driver reports it itself
            say_now(f"second signal ({signal_name(signum)}): stopping at once without saving; "
                    f"exiting with {128 + signum}")
        os._exit(128 + signum)

    def _relayed(self, signum, _frame) -> None:
        # The driver's copy of a stop signal; a worker that got the signal itself already has it.
        if not self.signum:
            self._first(signum - signal.SIGRTMIN)

    def _first(self, signum: int) -> None:
        self.signum = signum
        # Only the process the user signalled announces the save at once. A launcher's worker cannot
        # tell a stop request from the launcher tearing it down because a peer died (torch's agent
        # sends SIGTERM then too), and the save would never come: its word is the stop line at the
        # step boundary, once every rank agreed and the checkpoint is written.
        if self.parent is None:
            say_now(announcement(signum))

    def _watch_parent(self) -> None:
        stop = threading.Event()
        while not stop.wait(PARENT_POLL_S):
            if self._orphaned():
                self._exit_orphaned(signal.SIGINT)  # as spawn's parent-death signal would have ended it

    # --- the step boundary ---
    def agreed(self, rt) -> int:
        """The stop signal all ranks act on at this boundary (0: none); the same on every rank."""
        if not (rt.distributed and rt.world > 1):
            return self.signum
        if self.group is None:  # every rank reaches its first boundary: a collective call is safe
            self.group = dist.new_group(backend="gloo")
        agreed = 0
        if self.pending is not None:
            work, flag = self.pending
            work.wait()  # issued one step ago by every rank: long done
            agreed = int(flag.item())
        self.pending = None
        if not agreed:
            flag = torch.tensor([self.signum], dtype=torch.int32)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.pending = (work, flag)
        return agreed


def at_step_boundary(run, checkpointer) -> None:
    """After an optimizer step: when the ranks agree a stop signal arrived, save a checkpoint
    (unless this step's is saved already), print one line on rank 0 and raise Stopped."""
    stop = _active
    if stop is None:
        return
    signum = stop.agreed(run.rt)
    if not signum:
        return
    step = run.state.step
    saved = "no checkpointer, nothing saved"
    if checkpointer is not None:
        saved = f"saved {checkpointer.save_now(run)}"
    if run.rt.is_main:
        say(f"{signal_name(signum)} at step {step}: {saved}; exiting with {128 + signum}")
        command = continue_command()  # the driver's `dtrain train ...`; none under plain torchrun
        if command and checkpointer is not None:
            say(f"the same command continues it: {command}")
    raise Stopped(signum)
