"""Which rank is slow (train.straggler_ratio): each rank's own time in a sampled step, compared.

In synchronous training every rank's wall step time is the same: the fast ranks wait for the slow
one inside the collectives (DDP's gradient all-reduce, FSDP's all-gathers, the step's loss check).
So a rank's own time is its step less those waits, measured on one sampled step in every
train.straggler_every:
- its compute: torch.profiler over the step (CPU activity, and CUDA's where there is a GPU), the
  self time of every op (CPU) or kernel (CUDA) that is not communication (profile.is_communication);
  a kernel's time on the GPU is what a throttled or failing GPU stretches, an op's on the CPU what a
  busy core does;
- plus its wall time reading its batches (Run.read_s), which no collective interrupts: a slow disk
  or a stalled loader shows there.
What is left of the step, outside any op and outside reading (waiting in a collective's wait), is
not the rank's own.

The sampled step's seconds count as excluded time ("straggler_sample"), not training, as a profiled
window's do (trainer/fit/steplog.py's exclude_steps): the profiler's cost stays out of tokens/s and
MFU. Each rank's figure rides the next step's check all-reduce (trainer/fit/nonfinite.py), as a
vector of `world` numbers with its own in its place: no step gets a collective of its own (the
hosts' names are gathered once, at the start). Rank 0 logs them (`rank_step_s` in the next logged
step's metrics.jsonl record, plotted by `dtrain report` as ranks.png) and, when the slowest rank has
taken more than straggler_ratio times the other ranks' median for PATIENCE samples in a row, prints
one `dtrain:` notice naming it, its host and its time.

On a GPU the compute is the kernels' time alone: a rank whose host is slow to launch them (a busy
CPU, Python's garbage collector) shows only as far as its reading does."""

from __future__ import annotations

import math
import socket
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from trainer.observe.profile import is_communication, quiet_profiler
from trainer.observe.straggler_verdict import StragglerVerdict
from trainer.process.joblog import say

EXCLUDED = "straggler_sample"  # the sampled steps' kind of excluded seconds (TrainState.excluded_s)


def sample_period(log_interval: int, every: int) -> int:
    """Steps between sampled steps: the fewest whole log intervals spanning `every` steps
    (train.straggler_every), so that each sample is logged with the interval it falls in."""
    return log_interval * math.ceil(every / log_interval)


class StragglerWatch:
    """One per worker (Run.stragglers). `around(step)` profiles a sampled step; `rider()` is the
    vector the next step's check all-reduces; `arrived(values)` takes its reduced values back.
    Off (every method a no-op) for one process or train.straggler_ratio=0."""

    def __init__(self, cfg, rt, read_seconds):
        self.rt = rt
        self.on = rt.distributed and rt.world > 1 and cfg.train.straggler_ratio > 0
        self.period = sample_period(cfg.train.log_interval, cfg.train.straggler_every)
        self.read_seconds = read_seconds  # () -> this rank's seconds reading batches so far (Run.read_s)
        self.mine: float | None = None  # this rank's figure for the last sampled step, not yet sent
        self.sampled_step = 0
        self.latest: tuple[int, list[float]] | None = None  # rank 0: (sampled step, seconds by rank)
        self.verdict: StragglerVerdict | None = None
        if self.on:
            hosts: list[str] = [""] * rt.world  # every rank's host, for the notice (once per run)
            dist.all_gather_object(hosts, socket.gethostname())
            self.verdict = StragglerVerdict(cfg.train.straggler_ratio, hosts)

    def samples(self, step: int, first_step: int) -> bool:
        """Whether step `step` (1-based) is sampled: one per period, never a session's first step
        (compilation and warm-up)."""
        return self.on and step > first_step and step % self.period == 1 % self.period

    @contextmanager
    def around(self, step: int, steps):
        """Profile step `step` (`steps`: the loop's StepLog, which leaves its seconds out of training)."""
        activities = [ProfilerActivity.CPU]
        if self.rt.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        steps.exclude_steps(EXCLUDED)
        read_before = self.read_seconds()
        quiet_profiler()
        prof = profile(activities=activities)
        prof.start()
        try:
            yield
        finally:
            if self.rt.device.type == "cuda":
                torch.cuda.synchronize(self.rt.device)  # the step's kernels into the profile
            prof.stop()
        self.mine = own_seconds(prof) + self.read_seconds() - read_before
        self.sampled_step = step
        steps.exclude_steps(None)

    def rider(self, device) -> torch.Tensor | None:
        """The vector this rank adds to the step's check (its figure in its place), once per sample."""
        if self.mine is None:
            return None
        vector = torch.zeros(self.rt.world, dtype=torch.float32)
        vector[self.rt.rank] = self.mine
        self.mine = None
        return vector.to(device)

    def arrived(self, values: list[float]) -> None:
        """The rider's values after the check (the mean over ranks: each rank's figure / world)."""
        times = [value * self.rt.world for value in values]
        self.latest = (self.sampled_step, times)
        if self.rt.is_main:
            notice = self.verdict.add(times)
            if notice:
                say(notice)

    def take_record(self) -> dict:
        """The logged step's fields: the last sample's seconds by rank, once."""
        if self.latest is None:
            return {}
        (step, times), self.latest = self.latest, None
        return {"rank_step_s": [round(t, 6) for t in times], "rank_step_at": step}


def own_seconds(prof: profile) -> float:
    """A profiled step's compute on this rank (seconds), communication left out: the time of its
    kernels and copies on the GPU where the profile holds any (the device's events, not the user
    annotations that span them), else the self time of its CPU ops (an op's time less the ops inside
    it, so that nested ops count once and a collective's wait inside an op counts nowhere).

    Read from the profiler's raw events: building torch's FunctionEvent tree (prof.events()) took
    547 ms for one gpt2_124m step's 9,345 events on this machine's CPU, the raw read 20 ms."""
    raw = prof.profiler.kineto_results.events()
    device = [e for e in raw if e.device_type() != DeviceType.CPU and not e.is_user_annotation()]
    if device:
        return sum(e.duration_ns() for e in device if not is_communication(e.name())) / 1e9
    by_thread: dict[int, list] = {}
    for e in raw:
        by_thread.setdefault(e.start_thread_id(), []).append((e.start_ns(), -e.duration_ns(), e.name()))
    own_ns = 0
    for events in by_thread.values():
        events.sort()  # by start; at the same start the longer (enclosing) first
        open_ends: list[int] = []  # the end of each enclosing op
        open_self: list[list] = []  # [self ns, counts] of each enclosing op
        for start, minus_duration, name in events:
            while open_ends and open_ends[-1] <= start:
                own_ns += _closed(open_ends, open_self)
            if open_self:
                open_self[-1][0] += minus_duration  # a child's time is not its parent's own
            open_ends.append(start - minus_duration)
            open_self.append([-minus_duration, not is_communication(name)])
        while open_ends:
            own_ns += _closed(open_ends, open_self)
    return own_ns / 1e9


def _closed(open_ends: list[int], open_self: list[list]) -> int:
    open_ends.pop()
    self_ns, counts = open_self.pop()
    return max(0, self_ns) if counts else 0
