"""The one train/eval loop, Trainer.fit. Every parallelism mode runs it unchanged through its Strategy."""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.markup import escape

from trainer.config.batch import rank_factor
from trainer.errors import NonFiniteError
from trainer.evals.hellaswag import HellaSwagEval
from trainer.fit.run import Run
from trainer.fit.steplog import StepLog
from trainer.fit.target import TargetWatch, describe_target
from trainer.observe.inspection import StepInspection
from trainer.observe.metrics import MetricsLogger, ProgressView
from trainer.observe.provenance import describe, what_ran
from trainer.observe.trackers import open_trackers
from trainer.optim.build import describe_split
from trainer.process.hang_watch import HangWatch
from trainer.process.joblog import job_log
from trainer.process.runtime import Runtime
from trainer.process.signals import at_step_boundary
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.init_from import start_from_weights


@dataclass
class RunResult:
    final_loss: float
    best_val_loss: float
    tokens: int
    tokens_per_s: float  # tokens / wall_s: evaluation and checkpoints included, over every start
    train_tokens_per_s: float  # in training steps only, as the step lines measure it (this start's steps)
    wall_s: float  # the training loop's seconds over every start of the run (train_s plus excluded_s)
    steps: int
    final_val_bpb: float = math.nan  # bits per byte at the last validation (Run.val_loss)
    train_s: float = 0.0  # in training steps only, the first step of each session excepted (StepLog)
    excluded_s: dict = field(default_factory=dict)  # the other seconds by kind: beside the figures too
    session_wall_s: float = 0.0  # the training loop's seconds in this start alone (wall_s for a run never stopped)
    skipped: int = 0  # updates skipped for a non-finite loss or grad norm (train.on_nonfinite=skip)
    rollbacks: int = 0  # rollbacks to the newest finite checkpoint (train.on_nonfinite=rollback)
    # what produced the figures (trainer/observe/provenance.py): in the summary record beside the figures,
    # not among them (trackers log the figures)
    ran: dict = field(default_factory=dict)
    target: dict | None = None  # train.target_val_loss: beside the figures too (trainer/fit/target.py)
    tokens_by_source: dict | None = None  # a mixture's (data.mix) training tokens by source




class Trainer:
    """One worker's training: `Trainer(cfg, rt, run_dir, checkpointer).fit()` builds the Run
    (trainer/fit/run.py: model, strategy, optimizer, loaders), restores it from its checkpoint and
    steps it to train.max_steps (or its target), validating, evaluating and checkpointing on the
    way. Every parallelism mode runs this one loop unchanged through its Strategy."""

    def __init__(self, cfg, rt: Runtime, run_dir: Path, checkpointer=None):
        self.cfg, self.rt, self.run_dir, self.checkpointer = cfg, rt, run_dir, checkpointer

    def fit(self) -> RunResult:
        """Train according to cfg; rank 0 writes metrics.jsonl and prints, also to the job log
        (dtrain.log). Returns the run's figures."""
        cfg, rt, run_dir, checkpointer = self.cfg, self.rt, self.run_dir, self.checkpointer
        with job_log(rt.is_main):
            hellaswag = None
            if cfg.eval.hellaswag.interval > 0:  # the examples are read and tokenized once per run, not per eval
                hellaswag = HellaSwagEval.from_config(cfg, rt, load_tokenizer(cfg.tokenizer))
            run = Run(cfg, rt, run_dir)
            t = cfg.train
            if checkpointer is not None:
                checkpointer.restore(run)
                checkpointer.check_room_at_start(run)
            if cfg.model.init_from:
                start_from_weights(run, cfg.model.init_from, checkpointer and checkpointer.resumed_from)
            state = run.state
            start_step = state.step
            sinks = open_trackers(cfg, run_dir, start_step) if rt.is_main else []
            metrics = MetricsLogger(run_dir, rt.is_main, resume_step=start_step, sinks=sinks)
            view = ProgressView(rt.rank, t.max_steps, start_step, bar=t.progress)
            view.rank_line(f"pid {os.getpid()} on {socket.gethostname()}, world {rt.world}, device {rt.device}, "
                           f"from step {start_step}")
            if rt.is_main:
                n_params = run.strategy.unwrap(run.model).num_params()
                view.print(
                    f"[bold]dtrain[/] model={cfg.model.name} ({n_params / 1e6:.2f}M params) "
                    f"parallel={run.strategy.describe()} world={rt.world} device={rt.device} "
                    f"{describe_split(run.strategy.unwrap(run.model), cfg.optim)} | "
                    f"global batch {run.plan.total_batch_size:,} tokens = {t.micro_batch_size} x {t.seq_len} x "
                    f"{rank_factor(rt.dp_world, rt.world)} x {run.plan.grad_accum_steps} accum | run dir {run_dir}"
                    + (f" | resumed at step {start_step}" if start_step else "")
                )
            steps = StepLog(run, metrics, view)
            inspection = StepInspection(cfg, rt, run_dir, steps, view)  # train.profile.steps, memory, out-of-memory
            hang_watch = self._hang_watch(run)
            guard = run.guard
            watch = TargetWatch(t, run.flops_per_token)
            t_start = steps.t_first
            val_bpb = math.nan  # the last validation's bits per byte (the summary's)
            try:
                while state.step < t.max_steps:  # a rollback (train.on_nonfinite) sets state.step back
                    with inspection.around(state.step + 1):
                        if hang_watch:
                            hang_watch.step_begins()
                        steps.after_step(*run.train_step(state.step))
                        if hang_watch:
                            hang_watch.step_ends()
                    if not guard.finite and guard.respond(guard.describe(), run, checkpointer, metrics):
                        steps.restart_window()
                        continue
                    last = state.step == t.max_steps
                    if run.val_sets and ((t.val_interval and state.step % t.val_interval == 0) or last):
                        figures = run.val_figures()
                        val, bpb = figures["val_loss"], figures["val_bpb"]
                        if math.isfinite(val):
                            state.best_val_loss = min(state.best_val_loss, val)
                        val_bpb = bpb
                        metrics.log({"step": state.step, "tokens": state.tokens, **figures})
                        view.print(f"step {state.step}: val loss {val:.4f} | val bpb {bpb:.4f}" + _by_source(figures))
                        steps.restart_window(excluded="evaluation")  # tokens/s measures training, not evaluation
                        # the run ends at its target, unless train.continue_after_target
                        if watch.reached(figures, state):
                            view.print(f"time to target: {describe_target(state.target)}")
                            last = True
                        if not math.isfinite(val) and guard.respond(f"validation loss {val}", run, checkpointer,
                                                                    metrics):
                            continue
                    if hellaswag is not None and (state.step % cfg.eval.hellaswag.interval == 0 or last):
                        hs = hellaswag.evaluate(run.strategy.inference_model(run.model), rt, run.strategy.autocast)
                        metrics.log({"step": state.step, "tokens": state.tokens, **hs.metrics()})
                        view.print(f"step {state.step}: hellaswag acc_norm {hs.acc_norm:.4f} "
                                   f"acc_per_token {hs.acc_per_token:.4f} "
                                   f"acc {hs.acc:.4f} (n={hs.n})")
                        steps.restart_window(excluded="evaluation")
                    try:
                        if checkpointer is not None and checkpointer.after_step(run, last):
                            steps.restart_window(excluded="checkpoint")
                    except NonFiniteError as refused:  # non-finite weights after a finite step: rollback's business
                        guard.respond("weights", run, checkpointer, metrics, refused=refused)
                        steps.restart_window()
                    at_step_boundary(run, checkpointer)  # a stop signal: all ranks save here and raise Stopped
                    if last:  # max_steps, or the target reached
                        break
                now = time.perf_counter()
                wall = state.wall_s + now - steps.t_mark  # every start's, to this instant
                result = RunResult(
                    final_loss=state.last_loss,
                    best_val_loss=state.best_val_loss,
                    final_val_bpb=val_bpb,
                    tokens=state.tokens,
                    tokens_per_s=state.tokens / wall if wall > 0 else 0.0,  # both over every start
                    train_tokens_per_s=steps.training_tokens_per_s(),
                    wall_s=wall,
                    session_wall_s=now - t_start,
                    steps=state.step,
                    skipped=guard.skipped,
                    rollbacks=guard.rollbacks,
                    train_s=state.train_s,
                    excluded_s=dict(state.excluded_s),
                    ran=what_ran(rt, run.kernels) if rt.is_main else {},
                    target=watch.record(state),
                    tokens_by_source=run.tokens_by_source(),
                )
                view.close()
                if t.sample_tokens > 0:
                    text = run.sample(t.sample_prompt, t.sample_tokens, t.seed)
                    view.print("[bold]sample:[/]\n" + escape(text))
                view.summary("run summary", _summary_rows(result, run_dir, resumed=start_step > 0))
                view.rank_line(f"finished at step {state.step}")
                if rt.is_main:
                    figures = asdict(result)
                    beside = {key: figures.pop(key) for key in ("ran", "excluded_s", "target")}  # not numbers
                    beside = {k: v for k, v in beside.items() if v is not None}  # no target: no `target` record
                    if result.tokens_by_source is None:  # one dataset
                        figures.pop("tokens_by_source")
                    metrics.log({"step": state.step, "tokens": state.tokens, **beside, "summary": figures})
                return result
            finally:
                if hang_watch:
                    hang_watch.close()
                inspection.close()
                view.close()
                metrics.close()
                if checkpointer is not None:
                    checkpointer.close()


    def _hang_watch(self, run: Run) -> HangWatch | None:
        """The watch of a multi-process run's training steps (launch.hang_timeout_s; 0: none)."""
        rt, launch = self.rt, self.cfg.launch
        if not (rt.distributed and rt.world > 1) or launch.hang_timeout_s == 0:
            return None
        return HangWatch(rt.rank, rt.world, self.run_dir, run.progress, launch.hang_timeout_s, launch.timeout_s,
                         rt.device)


def _summary_rows(result: RunResult, run_dir: Path, resumed: bool) -> dict[str, str]:
    return {
        "steps": f"{result.steps}",
        "tokens": f"{result.tokens:,}",
        "final train loss": f"{result.final_loss:.4f}",
        "best val loss": "-" if math.isinf(result.best_val_loss) else f"{result.best_val_loss:.4f}",
        "final val bpb": f"{result.final_val_bpb:.4f}" if math.isfinite(result.final_val_bpb) else "-",
        # two figures, named so that neither is mistaken for the other (the step lines show the first)
        "tokens/s (training steps)": f"{result.train_tokens_per_s:,.0f}",
        "tokens/s (wall, with eval + ckpt)": f"{result.tokens_per_s:,.0f}",
        # a continued run's wall time is every start's, as its tokens are; this start's beside it
        "wall time": f"{result.wall_s:.1f} s" + (f" (this start {result.session_wall_s:.1f} s)" if resumed else ""),
        **({"time to target": describe_target(result.target)} if result.target else {}),
        **({"tokens by source": ", ".join(f"{name} {n:,} ({n / max(1, result.tokens):.1%})" for name, n in
                                          result.tokens_by_source.items())} if result.tokens_by_source else {}),
        "ran with": describe(result.ran),
        "run dir": str(run_dir),
    }


def _by_source(figures: dict[str, float]) -> str:
    """A mixture's validation loss per source, for the console line ("" for one dataset)."""
    losses = {key.split("/", 1)[1]: value for key, value in figures.items() if key.startswith("val_loss/")}
    return "".join(f" | {name} {value:.4f}" for name, value in losses.items())
