"""A hang names the stuck rank (launch.hang_timeout_s): a watchdog thread on every rank of a
multi-process run, instead of waiting for the process group's timeout (launch.timeout_s).

A rank that stops answering (frozen, a dead NIC, a collective it never reaches) holds every other
rank inside a collective. The loop arms the watch when a training step begins and disarms it when
the step ends (trainer/fit/loop.py). When a step has run longer than the limit, each rank's watch
thread, whatever the main thread is blocked in:

1. writes every thread's Python stack (faulthandler) to `<run dir>/hang/rank<R>.txt`, with where
   the step had got to (`StepProgress`: the micro-step and its phase, set by trainer/fit/run.py);
   on CUDA also NCCL's flight recorder (the collectives in flight) beside it;
2. says so in the process group's store (a key per rank: the store is its own TCP connection, which
   a stuck collective does not block) and waits a little for the other ranks to say so too;
3. the lowest rank that answered names the stuck one: a rank that did not answer (frozen, dead, or
   stuck outside Python), else the ranks that were behind the others (still reading their batch
   while the others waited in the backward's all-reduce); it puts its one line in the store, and
   every rank that answered records that line for the driver (trainer/process/error_record.py),
   ends the processes on its host that did not answer, and exits with the user-error code.

Only training steps are watched: evaluation, checkpoints and the first step of a session (compiling)
take their own time and are left to launch.timeout_s. The limit: launch.hang_timeout_s seconds, or
by default (null) STEP_MULTIPLE times the slowest step seen so far, at least FLOOR_S, and less than
launch.timeout_s so that the watch speaks first; 0 turns the watch off. Nothing touches the run's
checkpoints: the newest stays the newest, and the same command continues from it.

DTRAIN_INJECT_DELAY=RANK@STEP[,STEP...]:SECONDS (a testing hook, like DTRAIN_INJECT_NONFINITE; RANK@*
for every step) makes that rank sleep while it reads the first batch of those optimizer steps (a
straggler, trainer/observe/stragglers.py, or with a long sleep a hang).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.process.env import under_torchrun
from trainer.process.error_record import USER_ERROR_EXIT, write_error_record

HANG_DIR = "hang"
FLOOR_S = 120.0  # the default limit's least: a step's recompile or a slow node stays far below it
STEP_MULTIPLE = 10.0  # the default limit: this many times the slowest step seen
BELOW_TIMEOUT = 0.8  # the default limit stays this share of launch.timeout_s, so the watch speaks first
POLL_S = 0.25  # how often the watch thread looks at the armed step
KEY = "dtrain_hang/"
INJECT_DELAY_ENV = "DTRAIN_INJECT_DELAY"
# the driver's relay of stop signals (trainer/process/signals.py): set under dtrain's own launcher,
# whose driver prints a worker's recorded line; under plain torchrun the reporting rank prints it
RELAY_ENV = "DTRAIN_SIGNAL_RELAY"
PHASES = ("reading its batch", "forward", "backward", "optimizer step")


@dataclass
class StepProgress:
    """How far this rank's current optimizer step has got: the main thread writes it (a few
    attribute stores per micro-step), the watch thread reads it when a step hangs."""

    step: int = 0  # the optimizer step in progress, numbered as the step lines number it
    micro: int = 0  # its micro-step (0-based)
    micros: int = 1  # micro-steps per optimizer step
    phase: int = 0  # index into PHASES

    def at(self, micro: int, phase: int) -> None:
        self.micro, self.phase = micro, phase

    def order(self) -> tuple[int, int, int]:
        return self.step, self.micro, self.phase

    def describe(self) -> str:
        return f"step {self.step}, micro-step {self.micro + 1}/{self.micros}, {PHASES[self.phase]}"


@dataclass(frozen=True)
class InjectedDelay:
    """The testing hook's delay: `rank` sleeps `seconds` in each optimizer step of `steps` (None: every
    step) while it reads that step's first batch."""

    rank: int
    steps: frozenset[int] | None
    seconds: float

    def applies(self, rank: int, step: int) -> bool:
        return rank == self.rank and (self.steps is None or step in self.steps)


def injected_delay() -> InjectedDelay | None:
    """The testing hook DTRAIN_INJECT_DELAY=RANK@STEP[,STEP...]:SECONDS (RANK@*:SECONDS: every step),
    or None when it is unset."""
    spec = os.environ.get(INJECT_DELAY_ENV, "").strip()
    if not spec:
        return None
    where, _, seconds = spec.partition(":")
    rank, _, steps = where.partition("@")
    chosen = None if steps == "*" else frozenset(int(step) for step in steps.split(","))
    return InjectedDelay(int(rank), chosen, float(seconds))


# NCCL's flight recorder: a ring buffer of the last collectives each rank entered and completed, dumped
# beside the stacks (torchtitan turns it on by default too). The user's own settings win.
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """The environment that turns NCCL's flight recorder on for a CUDA run (read when the process
    group starts): each setting the user did not make under either of torch's names for it."""
    wanted = {
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"): str(FLIGHT_RECORDER_ENTRIES),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",  # NCCL's own timeout (launch.timeout_s) dumps it too
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): str(run_dir / HANG_DIR / "nccl_trace_rank_"),
    }
    return {names[0]: value for names, value in wanted.items() if not any(name in os.environ for name in names)}


def default_limit_s(slowest_step_s: float, process_group_timeout_s: float) -> float:
    """The limit when launch.hang_timeout_s is null (see the module doc)."""
    return min(max(FLOOR_S, STEP_MULTIPLE * slowest_step_s), BELOW_TIMEOUT * process_group_timeout_s)


class HangWatch:
    """The watch of one rank (see the module doc). `timeout_s`: launch.hang_timeout_s (None: the
    default limit; 0: off)."""

    def __init__(self, rank: int, world: int, run_dir: Path, progress: StepProgress, timeout_s: float | None,
                 process_group_timeout_s: float, device: torch.device):
        self.rank, self.world, self.run_dir, self.progress = rank, world, run_dir, progress
        self.timeout_s, self.pg_timeout_s, self.device = timeout_s, process_group_timeout_s, device
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.slowest_s = 0.0  # of the steps completed in this session
        self.armed_at: float | None = None  # monotonic time the watched step began
        self.armed_wall = 0.0
        self._closed = threading.Event()
        if device.type == "cuda":  # where NCCL's own timeout dumps its flight recorder (flight_recorder_env)
            (run_dir / HANG_DIR).mkdir(parents=True, exist_ok=True)
        self._store = dist.distributed_c10d._get_default_store()
        # who every rank is, for the report (a frozen rank cannot say it then)
        self._store.set(f"{KEY}who/{rank}", json.dumps({"host": self.host, "pid": self.pid}))
        self._thread = threading.Thread(target=self._watch, name="dtrain-hang-watch", daemon=True)
        self._thread.start()

    def limit_s(self) -> float | None:
        """The current limit, or None while the step is not watched (the session's first step)."""
        if self.timeout_s is not None:
            return float(self.timeout_s)
        return default_limit_s(self.slowest_s, self.pg_timeout_s) if self.slowest_s else None

    def step_begins(self) -> None:
        self.armed_wall = time.time()
        self.armed_at = time.monotonic()

    def step_ends(self) -> None:
        if self.armed_at is not None:
            self.slowest_s = max(self.slowest_s, time.monotonic() - self.armed_at)
        self.armed_at = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * POLL_S)

    # --- the watch thread --------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            armed, limit = self.armed_at, self.limit_s()
            if armed is not None and limit is not None and time.monotonic() - armed > limit:
                self._report(limit)

    def _report(self, limit: float) -> None:
        """Dump, agree on the stuck rank, record the line and end this process (never returns)."""
        where = self.progress.describe()
        stacks = self._dump_stacks(limit, where)
        answer = {"host": self.host, "pid": self.pid, "order": self.progress.order(), "where": where,
                  "stacks": str(stacks)}
        self._store.set(f"{KEY}answer/{self.rank}", json.dumps(answer))
        grace = min(30.0, max(5.0, limit / 2))
        answers = self._answers(grace)
        reporter = min(answers)
        if self.rank == reporter:
            line = self._line(answers, limit)
            self._store.set(f"{KEY}line", line)
        else:
            line = self._wait_for_line(grace) or self._line(answers, limit)
        if self.rank == reporter and RELAY_ENV not in os.environ and under_torchrun():
            print(f"error: {line}", file=sys.stderr, flush=True)  # plain torchrun: no driver prints it
        write_error_record("HangError", line, timestamp=self.armed_wall)  # the hang began when the step did
        self._end_silent_ranks(answers)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(USER_ERROR_EXIT)

    def _dump_stacks(self, limit: float, where: str) -> Path:
        folder = self.run_dir / HANG_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world}, host {self.host}, pid {self.pid}: no step completed for "
                    f"{limit:.0f} s; this rank was at {where}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        if self.device.type == "cuda":
            self._dump_flight_recorder(folder)
        return path

    def _dump_flight_recorder(self, folder: Path) -> None:
        """NCCL's flight recorder (the collectives each rank entered and finished), when torch has it."""
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if dump is not None:
            try:
                (folder / f"nccl_trace_rank{self.rank}.pickle").write_bytes(dump())
            except RuntimeError:  # the recorder is off (TORCH_NCCL_TRACE_BUFFER_SIZE=0)
                pass

    def _answers(self, grace: float) -> dict[int, dict]:
        """{rank: its answer} of the ranks that answered within `grace` seconds."""
        keys = [f"{KEY}answer/{r}" for r in range(self.world)]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(0.1)
        return {r: json.loads(self._store.get(key)) for r, key in enumerate(keys) if self._store.check([key])}

    def _wait_for_line(self, grace: float) -> str | None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._store.check([f"{KEY}line"]):
                return self._store.get(f"{KEY}line").decode()
            time.sleep(0.1)
        return None

    def _who(self, rank: int) -> dict:
        key = f"{KEY}who/{rank}"
        return json.loads(self._store.get(key)) if self._store.check([key]) else {"host": "?", "pid": "?"}

    def _line(self, answers: dict[int, dict], limit: float) -> str:
        """The one line: which rank is stuck, where the others were, the files, what to do."""
        silent = [r for r in range(self.world) if r not in answers]
        first = max(tuple(a["order"]) for a in answers.values())
        behind = [r for r, a in answers.items() if tuple(a["order"]) < first] if not silent else []
        waiting = [r for r in answers if r not in behind]

        def ranks(rs: list[int]) -> str:
            return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

        def named(r: int) -> str:
            who = self._who(r)
            return f"rank {r} ({who['host']}, pid {who['pid']})"

        if silent:
            culprit = (f"{', '.join(map(named, silent))} did not answer (frozen, dead, or stuck outside Python), "
                       f"while {ranks(waiting)} waited at {answers[waiting[0]]['where']}")
        elif behind:
            culprit = (f"{', '.join(named(r) for r in behind)} fell behind, at {answers[behind[0]]['where']}, "
                       f"while {ranks(waiting)} waited at {answers[waiting[0]]['where']}")
        else:
            culprit = f"every rank answered, at {answers[waiting[0]]['where']} (a collective no rank completes)"
        setting = "launch.hang_timeout_s" if self.timeout_s is not None else "launch.hang_timeout_s (default)"
        return (f"the run hung: no step completed for {limit:.0f} s ({setting}): {culprit}; the stacks of "
                f"{ranks(sorted(answers))} are in {self.run_dir / HANG_DIR}; the newest checkpoint is untouched: once "
                f"the stuck rank's node is healthy, the same command continues from it")

    def _end_silent_ranks(self, answers: dict[int, dict]) -> None:
        """SIGKILL the ranks on this host that did not answer: a frozen process holds its GPU and its
        launcher's teardown would wait for it (torchelastic's SIGTERM, then 30 s)."""
        for rank in range(self.world):
            who = self._who(rank)
            if rank not in answers and who["host"] == self.host and isinstance(who["pid"], int):
                try:
                    os.kill(who["pid"], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
