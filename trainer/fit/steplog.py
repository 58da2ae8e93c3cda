"""The loop's bookkeeping after each optimizer step (trainer/fit/loop.py): tokens/s windows, MFU, ETA,
the step's log record, and the split of the session's seconds into training (TrainState.train_s)
and the rest by kind (TrainState.excluded_s: warmup, evaluation, checkpoint, profile, memory_snapshot,
straggler_sample, other), which time to target (trainer/fit/target.py) reports. Each second counted
in one of them counts in TrainState.wall_s too: like them it adds up over every start of the run
(the checkpoint keeps it)."""

from __future__ import annotations

import time

import torch

from trainer.fit.experts import console_part
from trainer.observe.flops import device_peak_flops
from trainer.observe.metrics import MetricsLogger, ProgressView


class StepLog:
    """The loop's bookkeeping after each optimizer step: counters, and every log_interval steps
    (and on the first and last) one host sync for the loss, tokens/s, MFU, ETA and the log record.

    tokens/s is measured in windows that end at a logged step and restart after evaluation or a
    checkpoint, so it is training throughput; the summary's "training steps" figure is the same
    measure over all the windows but the session's first step, which holds torch.compile's
    compilation and the allocator's warm-up (23 s of a 30-step compiled gpt2_124m run on an H100:
    with it the figure read 16,828 tok/s against the step lines' 360,000); its wall-clock figure
    counts everything."""

    def __init__(self, run, metrics: MetricsLogger, view: ProgressView):  # run: trainer.fit.run.Run
        self.run, self.metrics, self.view = run, metrics, view
        t = run.cfg.train
        self.log_interval, self.max_steps = t.log_interval, t.max_steps
        self.first_step = run.state.step + 1
        self.tokens_per_step = run.plan.total_batch_size
        # MFU = model FLOPs per token x tokens/s over the peak of every device (all ranks' tokens).
        peak = device_peak_flops(run.rt.device, t.peak_flops)
        self.peak_total = peak * run.rt.world if peak else None
        self.trained_tokens = 0
        self.window_tokens = 0  # tokens and seconds of the windows closed at a logged step
        self.window_seconds = 0.0
        self.warmup_window: tuple[int, float] | None = None  # the first step's (see the docstring)
        self.excluding: str | None = None  # the kind of the steps now running when not training (exclude_steps)
        self.t_first = time.perf_counter()  # the training's start (ETA and the wall-clock figure)
        self.t_mark = self.t_first  # the end of the last step or pause: what follows is a step's or a pause's
        self.restart_window(self.t_first)

    def restart_window(self, now: float | None = None, excluded: str = "other") -> None:
        """Start a new tokens/s window (after evaluation or checkpointing, which are not training);
        the seconds since the last step count in state.excluded_s[excluded], not in train_s."""
        now = time.perf_counter() if now is None else now
        self._exclude(excluded, now)
        self.t_mark = self.t_window = now
        self.tokens_window = 0

    def exclude_steps(self, kind: str | None) -> None:
        """The steps from the next on are `kind` time, not training (None: training again), as a
        profiled window is (trainer/observe/profile.py): their seconds count in state.excluded_s[kind]
        and their tokens in no window of the training figure. Each switch starts a new window."""
        self.restart_window(excluded=self.excluding or "other")
        self.excluding = kind

    def _exclude(self, kind: str, now: float) -> None:
        if now > self.t_mark:
            state = self.run.state
            state.excluded_s[kind] = state.excluded_s.get(kind, 0.0) + now - self.t_mark
            state.wall_s += now - self.t_mark

    def after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """Account for the step Run.train_step just completed; log it when due."""
        state = self.run.state
        now = time.perf_counter()  # the step has ended: its loss and grad norm were read (nonfinite.py)
        # compilation and warm-up (the docstring), or a window of excluded steps: not training time
        kind = "warmup" if state.step == self.first_step else self.excluding
        if kind is not None:
            self._exclude(kind, now)
        else:
            state.train_s += now - self.t_mark
            state.wall_s += now - self.t_mark
        self.t_mark = now
        self.tokens_window += self.tokens_per_step
        self.trained_tokens += self.tokens_per_step
        finite = self.run.guard.finite  # a non-finite step is always logged (its numbers as null)
        if finite and state.step % self.log_interval and state.step not in (self.max_steps, self.first_step):
            return
        loss_value = float(loss)  # reduced over ranks and read by the step's check: no extra sync
        tokens_per_s = self.tokens_window / (now - self.t_window)
        if self.warmup_window is None:
            self.warmup_window = (self.tokens_window, now - self.t_window)
        elif self.excluding is None:
            self.window_tokens += self.tokens_window
            self.window_seconds += now - self.t_window
        self.restart_window(now)
        if finite:
            state.last_loss = loss_value
        record = {
            "step": state.step,
            "tokens": state.tokens,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "skipped": self.run.guard.take_skips(),  # updates skipped since the previous train line
        }
        if self.peak_total:
            record["mfu"] = self.run.flops_per_token * tokens_per_s / self.peak_total
        by_source = self.run.tokens_by_source()
        if by_source is not None:  # a mixture (data.mix): its training tokens by source so far
            record["tokens_by_source"] = by_source
        extra = ""
        experts = self.run.experts
        if experts is not None:  # a MoE model: the aux loss and the interval's expert load (every rank)
            record.update(experts.record(experts.take_load()))
            extra = console_part(record)
        record.update(self.run.stragglers.take_record())  # a multi-process run: the last sample's times by rank
        self.metrics.log(record)
        self.view.update(state.step, loss_value, lr, tokens_per_s, record.get("mfu"), self._eta(now), extra)

    def _eta(self, now: float) -> float | None:
        """Seconds left at this session's pace so far (evaluation and checkpoints included)."""
        done = self.run.state.step - self.first_step + 1
        if done <= 0:
            return None
        return (now - self.t_first) / done * (self.max_steps - self.run.state.step)

    def training_tokens_per_s(self) -> float:
        """Over every logged window but the first step's; a session of one window has only that one."""
        tokens, seconds = self.window_tokens, self.window_seconds
        if seconds <= 0 and self.warmup_window is not None:
            tokens, seconds = self.warmup_window
        return tokens / seconds if seconds > 0 else 0.0
