"""The loop's one hook for looking inside its steps: the profiled window (trainer/observe/profile.py),
the allocator's history and out-of-memory line (trainer/observe/memory.py) and the straggler watch's
sampled steps (trainer/observe/stragglers.py), around each optimizer step of trainer/fit/loop.py."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

from trainer.observe.memory import MemoryRecorder
from trainer.observe.profile import StepProfiler


class StepInspection:
    """`with inspection.around(step): ...one optimizer step and its bookkeeping...` (step: its number,
    1-based); `close()` when the loop ends, however it ends. `steps`: the loop's StepLog, `view` its
    ProgressView."""

    def __init__(self, cfg, rt, run_dir: Path, steps, view):
        self.steps = steps
        self.stragglers = steps.run.stragglers
        self.profiler = StepProfiler(cfg, rt, run_dir, steps, view)
        self.memory = MemoryRecorder(cfg, rt, run_dir, dump_step=self.profiler.first_step or steps.first_step)

    @contextmanager
    def around(self, step: int):
        # one profiler at a time: a profiled window's steps are not sampled
        sampled = self.stragglers.samples(step, self.steps.first_step) and not self.profiler.covers(step)
        with self.memory.watch(step), self.profiler.around(step), \
                (self.stragglers.around(step, self.steps) if sampled else nullcontext()):
            yield
        if self.memory.after_step(step):
            self.steps.restart_window(excluded="memory_snapshot")  # the dump is not the next step's time

    def close(self) -> None:
        self.profiler.close()
        self.memory.close()
