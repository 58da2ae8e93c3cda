"""Non-finite training steps (`train.on_nonfinite`): the check before every update, and what follows.

The check: a step's mean loss and its gradient norm go through one all-reduce (a sum, so a NaN or
inf on any rank makes the result non-finite on every rank) and are read on the host once. That
read is the step's only host sync: the logged loss is the same number, so logging adds none. Every
rank decides from the same reduced numbers, so all ranks update, skip, roll back or stop together.
Where every optimizer can mask its update on device (fused AdamW and Muon take found_inf, as
GradScaler skips a step), the update is queued under the device-side verdict and the host reads it
after: an accelerator is not left idle while the host waits for it before launching the update.

What follows a non-finite step (no update was made for it) or validation loss:
  stop      raise NonFiniteError: one `error:` line naming the step, the numbers and the newest
            finite checkpoint, exit code 1; no checkpoint is written for the step.
  skip      go on without that step's update (the data position and the schedule move on); the
            max_nonfinite-th non-finite step in a row stops the run as above.
  rollback  reload the newest finite checkpoint (model, optimizer, counters, RNG) but keep the
            data position where it is, past the batches that failed; max_nonfinite rollbacks in
            one process, then the next failure stops. With no checkpoint yet, it stops (one line).

DTRAIN_INJECT_NONFINITE=STEP[,STEP...] (a testing hook) multiplies the loss of those steps (as
metrics.jsonl numbers them) by NaN on every rank, once per process, so that it flows through the
real check; a rollback or skip then gets past the step.
"""

from __future__ import annotations

import copy
import math
import os

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from trainer.checkpoint.layout import latest_checkpoint
from trainer.errors import ConfigError, NonFiniteError
from trainer.process.joblog import say
from trainer.process.runtime import Runtime

INJECT_ENV = "DTRAIN_INJECT_NONFINITE"


def injected_steps() -> set[int]:
    """The steps DTRAIN_INJECT_NONFINITE names (none when unset)."""
    text = os.environ.get(INJECT_ENV, "").strip()
    try:
        return {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ConfigError(f"{INJECT_ENV}={text!r} must be step numbers separated by commas, e.g. 5,6") from None


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class NonFiniteGuard:
    """One per worker (Run.guard): the per-step check and the response train.on_nonfinite asks for."""

    def __init__(self, train_cfg, rt: Runtime):
        self.action, self.limit, self.rt = train_cfg.on_nonfinite, train_cfg.max_nonfinite, rt
        self.inject = injected_steps()
        self.finite = True  # the verdict on the last checked step
        self.loss = self.grad_norm = math.nan  # its numbers, reduced over ranks
        self.in_a_row = 0  # non-finite steps (and validation losses) since the last finite step
        self.skipped = 0  # updates skipped in this process (skip)
        self.unlogged_skips = 0  # of those, since the last train line of metrics.jsonl
        self.rollbacks = 0
        self._pending: torch.Tensor | None = None  # the last checked step's reduced (loss, grad norm, beside)
        self.beside: list[float] = []  # its `beside` figures (check), read with the loss

    def poisons(self, step: int) -> bool:
        """Whether the testing hook makes the loss of the step that completes as `step + 1` non-finite."""
        if step + 1 not in self.inject:
            return False
        self.inject.discard(step + 1)
        return True

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, on_device: bool = False,
              beside: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All ranks' verdict on one step, before its update; returns (the mean loss over ranks,
        found_inf). Without `on_device` the verdict is read here (found_inf is None); with it,
        found_inf is a device tensor (1.0: skip the update) for an optimizer that masks its update
        on device, and `settle` reads the verdict once that update is queued. `beside`: more of the
        step's figures (a MoE model's aux loss, a straggler sample's times; one vector) averaged over
        ranks in the same all-reduce and read in the same sync (`self.beside`); the verdict is the
        loss's and the gradient norm's."""
        parts = [loss.reshape(1), grad_norm.to(loss.dtype).reshape(1)]
        if beside is not None:
            parts.append(beside.to(loss.dtype).reshape(-1))
        stats = torch.cat(parts)
        if self.rt.distributed and self.rt.world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            stats /= self.rt.world  # the same arithmetic as Runtime.all_reduce_mean: the same loss
        self._pending = stats
        if not on_device:
            self.settle()
            return stats[0], None
        return stats[0], (~torch.isfinite(stats[:2]).all()).to(torch.float32)

    def settle(self) -> None:
        """Read the checked step's verdict on the host (the step's one host sync: the logged loss
        is the same number, so logging adds none)."""
        self.loss, self.grad_norm, *self.beside = self._pending.tolist()
        self.finite = math.isfinite(self.loss) and math.isfinite(self.grad_norm)
        if self.finite:
            self.in_a_row = 0
        elif self.action == "skip":
            self.skipped += 1
            self.unlogged_skips += 1

    def take_skips(self) -> int:
        """Updates skipped since the previous call (the `skipped` field of a metrics.jsonl line)."""
        count, self.unlogged_skips = self.unlogged_skips, 0
        return count

    def describe(self) -> str:
        """What failed on the last checked step, with its numbers (for respond's `what`)."""
        return f"loss ({_fmt(self.loss)}, grad norm {_fmt(self.grad_norm)})"

    def respond(self, what: str, run, checkpointer, metrics, refused: NonFiniteError | None = None) -> bool:
        """After a non-finite `what` at run.state.step (a training step that made no update, a
        validation loss, or a checkpoint the Checkpointer `refused`): raise NonFiniteError, go on
        (skip: False) or roll back (True: the loop goes on from the restored step)."""
        step = run.state.step
        self.in_a_row += 1
        if self.action == "stop" or (self.action == "skip" and refused is not None):
            raise refused or self._stop(f"{what} at step {step}", checkpointer)
        if self.action == "skip":
            if self.in_a_row < self.limit:
                return False
            raise self._stop(f"{what} at step {step}, {self.in_a_row} in a row "
                             f"(train.max_nonfinite={self.limit})", checkpointer)
        if self.rollbacks >= self.limit:
            raise self._stop(f"{what} at step {step} after {self.rollbacks} rollbacks "
                             f"(train.max_nonfinite={self.limit})", checkpointer)
        target = self.newest(checkpointer)
        if target is None:
            raise self._stop(f"{what} at step {step} and no checkpoint to roll back to yet "
                             "(checkpoint.interval sets how often one is written)", checkpointer)
        self.rollbacks += 1
        position = run.train_loader.state_dict()
        # Restore as a resume from that very checkpoint does (the same checks and loads).
        view = copy.copy(checkpointer)
        view.cfg = OmegaConf.merge(checkpointer.cfg, {"resume": target})
        view.restore(run)
        # ...but read on from here: the batches that failed (and those that led there) are passed.
        run.train_loader.load_state_dict(position)
        state = run.state
        metrics.rewind(state.step)
        metrics.log({"step": state.step, "tokens": state.tokens,
                     "rollback": {"from_step": step, "count": self.rollbacks, "checkpoint": target}})
        if self.rt.is_main:
            say(f"non-finite {what} at step {step}: rolled back to {target} (step {state.step}), "
                f"data position kept past the failed batches (rollback {self.rollbacks} of {self.limit})")
        return True

    def newest(self, checkpointer) -> str | None:
        """The newest finite checkpoint, as rank 0 sees it (all ranks call this together). Every
        checkpoint the Checkpointer writes is checked finite first, so it is the newest one written
        (an async save in flight is published first), or the one this run resumed from."""
        if checkpointer is None:
            return None
        checkpointer.flush()
        found = None
        if self.rt.is_main:
            ckpt = latest_checkpoint(checkpointer.root) or checkpointer.resumed_from
            found = None if ckpt is None else str(ckpt)
        return self.rt.broadcast_object(found)

    def _stop(self, what: str, checkpointer) -> NonFiniteError:
        newest = self.newest(checkpointer)
        where = f"the newest finite checkpoint is {newest}" if newest else "no checkpoint was written"
        return NonFiniteError(f"non-finite {what}: no update and no checkpoint were made for it; {where}; "
                              "lower optim.lr, or see train.on_nonfinite")
