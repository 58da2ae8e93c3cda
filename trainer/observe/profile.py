"""train.profile.steps=[START, END]: torch.profiler over those optimizer steps of a run (1-based, as
the step lines number them), on every rank. Each rank writes a Chrome / Perfetto trace to
<run dir>/profile/rank<R>.json.gz; rank 0 prints a table at the window's end: the ops that took the
most self time, the profiled steps' mean wall time and the share of it with communication in flight.
The window's seconds count as excluded time ("profile"), not training (trainer/fit/steplog.py's
exclude_steps), so tokens/s and MFU leave them out as they leave out warm-up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from rich.markup import escape
from torch.profiler import ProfilerActivity, profile, record_function

from trainer.process.joblog import say

TOP_OPS = 12  # rows of rank 0's table
STEP_LABEL = "dtrain step "  # each profiled step's span in the trace: "dtrain step 3"
# Op and kernel names of communication, matched in lower case. Read from real traces (torch 2.13, CPU
# gloo, world 2): ddp's gradient buckets show only as `gloo:all_reduce` on gloo's worker threads, and
# the step's loss / grad-norm reduction as `c10d::allreduce_` on the caller's; fsdp adds
# `c10d::_allgather_base_` and `c10d::_reduce_scatter_base_` (gloo threads: `gloo:all_gather`),
# FSDP's `FSDP::all_gather*` / `fsdp::all_gather_copy_in` spans (their copies included) and
# `_c10d_functional::all_reduce` / `wait_tensor` for the DTensor grad norm. On CUDA, NCCL's kernels
# are `ncclDevKernel_*` and its host spans `nccl:*`. The share is the union of their intervals, so
# nested or concurrent ones count once.
COMM_MARKERS = ("c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "record_param_comms")


def quiet_profiler() -> None:
    """Kineto, the profiler's engine, prints `USDT: ... profiler_start` and `profiler_stop` on stderr
    each time a profiler starts and stops: a line pair per straggler sample in a user's console. Its
    level is read when a profiler first starts; 6 is above every level it has. A user's own setting wins."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def is_communication(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


class StepProfiler:
    """The profiled window of one rank. `around(step)` wraps one optimizer step (its number, 1-based);
    `close()` ends a window the run did not reach the end of (a target met, a stop) and writes it.
    `steps` is the loop's StepLog (the window's seconds are excluded through it), `view` its
    ProgressView (rank 0's table)."""

    def __init__(self, cfg, rt, run_dir: Path, steps, view):
        self.rt, self.steps, self.view = rt, steps, view
        self.folder = run_dir / "profile"
        window = cfg.train.profile.steps
        first = steps.first_step  # this start's first step (a continuation's may be inside the window)
        self.window = None if window is None else (max(window[0], first), window[1])
        if self.window is not None and self.window[0] > self.window[1]:
            if rt.is_main:
                say(f"train.profile.steps=[{window[0]},{window[1]}] ended before this start at step {first}: "
                    "nothing is profiled")
            self.window = None
        self.profiler: profile | None = None
        self.step_seconds: list[float] = []

    @property
    def first_step(self) -> int | None:
        """The first step this start profiles (None: none)."""
        return self.window[0] if self.window else None

    def covers(self, step: int) -> bool:
        """Whether step `step` is in the window still to profile."""
        return self.window is not None and self.window[0] <= step <= self.window[1]

    def around(self, step: int):
        """A context manager for step `step`: the window opens before its first step and is written
        after its last."""
        return _ProfiledStep(self, step) if self.covers(step) else _NOT_PROFILED

    def _open(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.rt.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.steps.exclude_steps("profile")
        quiet_profiler()
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False)
        self.profiler.start()

    def _write(self) -> None:
        """Stop the profiler, write this rank's trace and (rank 0) print the table."""
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)  # the window's kernels into its trace
        prof, self.profiler = self.profiler, None
        prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rt.rank}.json.gz"
        prof.export_chrome_trace(str(trace))  # gzip: the name ends in .gz
        if self.rt.is_main:
            self.view.print(escape(profile_table(prof, self.step_seconds, self.window, trace.parent)))
        self.window = None  # written: a rollback into the window does not profile it again
        self.steps.exclude_steps(None)  # the export's seconds count as the window's too

    def abandon(self) -> None:
        """A step failed inside the window: stop the profiler and write nothing."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler, self.window = None, None
            self.steps.exclude_steps(None)

    def close(self) -> None:
        """The run ended (or stopped) inside the window: write what was profiled."""
        if self.profiler is not None:
            self._write()


class _ProfiledStep:
    def __init__(self, owner: StepProfiler, step: int):
        self.owner, self.step = owner, step

    def __enter__(self):
        if self.owner.profiler is None:
            self.owner._open()
        self.label = record_function(f"{STEP_LABEL}{self.step}")  # the step's span in the trace
        self.label.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, kind, error, tb):
        self.label.__exit__(kind, error, tb)
        if kind is not None:
            self.owner.abandon()
            return False
        self.owner.step_seconds.append(time.perf_counter() - self.t0)  # the step ended with its loss read
        if self.step == self.owner.window[1]:
            self.owner._write()
        return False


class _NotProfiled:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NOT_PROFILED = _NotProfiled()


def profile_table(prof: profile, step_seconds: list[float], window: tuple[int, int], folder: Path) -> str:
    """Rank 0's table: the top ops by self time (CUDA's where the trace has kernels, else the CPU's),
    the profiled steps' mean wall time and the share of it with communication in flight."""
    averages = prof.key_averages()
    on_device = any(_self_device_us(e) > 0 for e in averages)
    ops = [e for e in averages if not e.key.startswith(STEP_LABEL)]  # the step spans are not ops
    ranked = sorted(ops, key=_self_device_us if on_device else (lambda e: e.self_cpu_time_total), reverse=True)
    wall_us = sum(step_seconds) * 1e6
    comm_us = _union_us([(e.time_range.start, e.time_range.end) for e in prof.events() if is_communication(e.name)])
    mean = sum(step_seconds) / max(1, len(step_seconds))
    lines = [f"profile of steps {window[0]}-{window[0] + len(step_seconds) - 1}: mean step {mean * 1e3:.1f} ms, "
             f"communication in flight {comm_us / wall_us if wall_us else 0:.1%} of it; traces in {folder}/"]
    width = max([len("op")] + [len(_short(e.key)) for e in ranked[:TOP_OPS]])
    header = f"  {'op':<{width}}  {'self CPU':>10}" + (f"  {'self CUDA':>10}" if on_device else "") + f"  {'calls':>6}"
    lines.append(header)
    for e in ranked[:TOP_OPS]:
        device = f"  {_ms(_self_device_us(e)):>10}" if on_device else ""
        lines.append(f"  {_short(e.key):<{width}}  {_ms(e.self_cpu_time_total):>10}{device}  {e.count:>6}")
    return "\n".join(lines)


def _self_device_us(event) -> float:
    # torch renamed self_cuda_time_total to self_device_time_total (2.4); the floor torch has both
    return getattr(event, "self_device_time_total", 0.0) or 0.0


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f} ms"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (microseconds)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total
