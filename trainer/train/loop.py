"""The one train/eval loop. Every parallelism mode runs it unchanged through its Strategy."""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.markup import escape

from trainer.checkpoint.init_from import start_from_weights
from trainer.config.schema import BatchPlan, batch_plan
from trainer.data.loader import ShardLoader
from trainer.data.mix_loader import MixtureLoader
from trainer.data.mixture import mixed_figures, mixture_weights, source_configs
from trainer.data.shard_reader import open_split, redo_command
from trainer.data.val_set import ValidationSet
from trainer.errors import NonFiniteError
from trainer.evals.generate import generate_text
from trainer.evals.hellaswag import HellaSwagEval
from trainer.model.gpt import build_model
from trainer.observe.metrics import MetricsLogger, ProgressView
from trainer.observe.provenance import describe, what_ran
from trainer.observe.trackers import open_trackers
from trainer.optim.build import build_optimizer, describe_split, masks_on_device
from trainer.optim.schedule import lr_at, set_lr
from trainer.parallel import make_strategy
from trainer.process.joblog import job_log, say
from trainer.process.runtime import Runtime
from trainer.process.signals import at_step_boundary
from trainer.tokenizers.load import load_tokenizer
from trainer.train.nonfinite import NonFiniteGuard
from trainer.train.steplog import StepLog
from trainer.train.target import TargetWatch, describe_target


@dataclass
class TrainState:
    """Counters that a checkpoint restores (the model, optimizer and loaders save their own)."""

    step: int = 0  # optimizer steps completed
    tokens: int = 0  # training tokens consumed, all ranks
    best_val_loss: float = math.inf
    last_loss: float = math.nan
    train_s: float = 0.0  # seconds in training steps (StepLog), all sessions
    excluded_s: dict = field(default_factory=dict)  # the other seconds, by kind: evaluation, checkpoint, ...
    wall_s: float = 0.0  # the training loop's seconds, all sessions: train_s plus excluded_s (StepLog)
    target: dict | None = None  # train.target_val_loss's record once reached (trainer/train/target.py)


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
    target: dict | None = None  # train.target_val_loss: beside the figures too (trainer/train/target.py)
    tokens_by_source: dict | None = None  # a mixture's (data.mix) training tokens by source


class Run:
    """Everything one worker builds for training: model, strategy, optimizer, loaders, logger."""

    def __init__(self, cfg, rt: Runtime, run_dir: Path):
        self.cfg, self.rt, self.run_dir = cfg, rt, run_dir
        self.plan: BatchPlan = batch_plan(cfg, rt.world)
        # The same seed on every rank: replicas start identical without a broadcast.
        torch.manual_seed(cfg.train.seed)
        if rt.device.type == "cuda":
            # TF32 tensor cores for the fp32 matmuls left outside autocast (bf16 does the rest).
            torch.set_float32_matmul_precision("high")
        self.tokenizer = load_tokenizer(cfg.tokenizer)  # its vocabulary bounds the loaders' ids
        self.strategy = make_strategy(cfg.parallel, cfg.train, rt)
        raw_model = build_model(cfg.model)
        raw_model.activation_checkpointing = cfg.train.activation_checkpointing
        raw_model.loss_chunks = cfg.train.loss_chunks
        self.model = self.strategy.wrap(raw_model)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.strategy)
        self.mix_weights = mixture_weights(cfg.data)  # None: one dataset
        sources = source_configs(cfg.data) or {cfg.data.name: cfg.data}
        self.train_loader = self._mixture_loader(sources) if self.mix_weights else self._loader(cfg.data)
        self.val_sets: dict[str, ValidationSet] = {}  # every source's (one dataset: its own)
        if cfg.data.val_fraction > 0 and cfg.train.val_tokens > 0:
            self.val_sets = {name: self._val_set(data) for name, data in sources.items()}
            # bytes per id of the (padded) head; padding rows never stand for text: 0
            known = self.tokenizer.byte_lengths()[: raw_model.config.padded_vocab_size]
            padding = [0] * (raw_model.config.padded_vocab_size - len(known))
            self.token_bytes = torch.tensor([*known, *padding], dtype=torch.int64, device=rt.device)
        self.forward = self.model
        if cfg.train.compile:
            self.forward = torch.compile(self.model, mode=cfg.train.compile_mode)
        self.state = TrainState()
        self.guard = NonFiniteGuard(cfg.train, rt)
        self.masks_on_device = masks_on_device(self.optimizer)
        self.flops_per_token = self.strategy.unwrap(self.model).flops_per_token(cfg.train.seq_len)

    def _val_set(self, data) -> ValidationSet:
        """The first train.val_tokens tokens of the val split (trainer/data/val_set.py), or as many
        as it holds (rank 0 says so)."""
        t = self.cfg.train
        what = f"val split of dataset {data.name!r}"
        val = ValidationSet(open_split(data, "val"), t.val_tokens, t.micro_batch_size, t.seq_len, self.rt.rank,
                            self.rt.world, self.rt.device, self.tokenizer.vocab_size, what, redo_command(data))
        if val.sequences < val.wanted and self.rt.is_main:
            say(f"the {what} holds {val.sequences:,} sequences of seq_len {t.seq_len} ({val.tokens:,} tokens), "
                f"fewer than train.val_tokens={t.val_tokens:,} asks: validation scores them all")
        return val

    def _mixture_loader(self, sources: dict) -> MixtureLoader:
        t = self.cfg.train
        return MixtureLoader({name: open_split(data, "train") for name, data in sources.items()}, self.mix_weights,
                             t.micro_batch_size, t.seq_len, self.rt.rank, self.rt.world, self.plan.grad_accum_steps,
                             t.seed, self.rt.device, vocab_size=self.tokenizer.vocab_size,
                             redo={name: redo_command(data) for name, data in sources.items()})

    def _loader(self, data) -> ShardLoader:
        t = self.cfg.train
        return ShardLoader(
            open_split(data, "train"),
            t.micro_batch_size,
            t.seq_len,
            self.rt.rank,
            self.rt.world,
            self.plan.grad_accum_steps,
            t.seed,
            self.rt.device,
            shuffle_shards=True,
            what=f"train split of dataset {data.name!r}",
            vocab_size=self.tokenizer.vocab_size,
            redo=redo_command(data),
        )

    # --- one optimizer step ----------------------------------------------------------------
    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step: the scheduled lr, the micro-steps, then clip, check, update (only when
        the loss and grad norm are finite on every rank: `guard.finite`) and count the step in
        `state`. Returns (mean loss over all ranks, grad norm, lr); the check's read of the two is
        the step's one host sync. Its two phases are methods of their own so that benchmarks time
        this very code."""
        lr = lr_at(step, self.cfg.optim, self.cfg.train.max_steps)
        set_lr(self.optimizer, lr)
        loss = self.forward_backward(poison=self.guard.poisons(step))
        loss, grad_norm = self.optimizer_step(loss)
        self.state.step = step + 1
        self.state.tokens += self.plan.total_batch_size
        return loss, grad_norm, lr

    def forward_backward(self, poison: bool = False) -> torch.Tensor:
        """Forward and backward of the step's grad_accum_steps micro batches from the train loader
        (gradients sync on the last); returns their mean loss on device. `poison`: the testing hook
        DTRAIN_INJECT_NONFINITE (trainer/train/nonfinite.py) makes the loss NaN."""
        if not self.strategy.unwrap(self.model).training:
            # Only after an evaluation: train() rewrites every module's `training` attribute, and
            # torch.compile's guards then re-check each module's state on the next call (the
            # compiled step's host time grows by it, every step)
            self.model.train()
        accum = self.plan.grad_accum_steps
        loss_sum = torch.zeros((), device=self.rt.device)
        for micro in range(accum):
            x, y = self.train_loader.next_batch()
            with self.strategy.micro_step(self.model, is_last=micro == accum - 1):
                with self.strategy.autocast():
                    # Only the loss: holding the logits (B x T x vocab) through backward would keep
                    # the largest activation alive for nothing.
                    loss = self.forward(x, y)[1]
                    if poison:
                        loss = loss * math.nan
                # Each micro-step's gradient is 1/accum of the step's mean-loss gradient.
                (loss / accum).backward()
            loss_sum += loss.detach()
        return loss_sum / accum

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the gradients, check the step on every rank (trainer/train/nonfinite.py) and update the
        weights only when it is finite (else drop the gradients): masked on device where the
        optimizer can, so no host sync comes before the update. Returns (mean loss over all ranks,
        gradient norm before clipping)."""
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        loss, found_inf = self.guard.check(loss, grad_norm, on_device=self.masks_on_device)
        if found_inf is not None:
            # The update is masked on device; the verdict is read once it is queued.
            self.strategy.optimizer_step(self.optimizer, found_inf)
            self.guard.settle()
        elif self.guard.finite:
            self.strategy.optimizer_step(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def val_loss(self) -> tuple[float, float]:
        """(mean loss, bits per byte) of validation (val_figures): a mixture's overall figures."""
        figures = self.val_figures()
        return figures["val_loss"], figures["val_bpb"]

    @torch.no_grad()
    def val_figures(self) -> dict[str, float]:
        """`val_loss` (mean loss per token) and `val_bpb` (bits per byte) over the validation set (the
        first train.val_tokens tokens of the val split, all ranks); a mixture's per source too
        (`val_loss/<source>`, ...) and overall at the sources' weights (mixture.mixed_figures). Bits
        per byte: the summed loss in bits over the UTF-8 bytes the target tokens stand for (a
        document boundary stands for none and is left out, as nanochat counts it), so runs with
        different tokenizers compare."""
        model = self.strategy.inference_model(self.model)
        model.eval()
        sums = {name: self._val_sums(model, val) for name, val in self.val_sets.items()}
        if self.mix_weights:
            return mixed_figures(sums, self.mix_weights)
        nats, nats_in_bytes, nbytes, targets = sums[self.cfg.data.name]
        return {"val_loss": nats / targets, "val_bpb": nats_in_bytes / (math.log(2) * nbytes) if nbytes else math.nan}

    def _val_sums(self, model, val: ValidationSet) -> list[float]:
        """[nats over every target, nats over the targets that stand for bytes, their bytes, targets]
        of one validation set, summed per token over all ranks (float64: the same figure whatever
        the batches the set is cut into)."""
        sums = torch.zeros(4, dtype=torch.float64, device=self.rt.device)
        for x, y, kept in val:
            with self.strategy.autocast():
                _, losses = model(x, y, per_token=True)
            kept = kept.reshape(-1)
            # where, not a product: a padding row's non-finite loss must not count either
            nats = torch.where(kept, losses.double(), 0.0)
            nbytes = torch.where(kept, self.token_bytes[y.reshape(-1)], 0)
            sums += torch.stack([nats.sum(), torch.where(nbytes > 0, nats, 0.0).sum(), nbytes.sum().double(),
                                 kept.sum().double()])
        return self.rt.all_reduce_sum(sums).tolist()

    def tokens_by_source(self) -> dict[str, int] | None:
        """A mixture's training tokens by source so far (metrics.jsonl's step records, the summary)."""
        return self.train_loader.tokens_by_source() if self.mix_weights else None

    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int, seed: int) -> str:
        """Generate on every rank in lockstep (FSDP forwards need all ranks); rank 0 prints."""
        model = self.strategy.inference_model(self.model)
        model.eval()
        return generate_text(model, prompt, max_new_tokens, device=self.rt.device, seed=seed,
                             tokenizer=self.tokenizer,
                             autocast=self.strategy.autocast)


def train(cfg, rt: Runtime, run_dir: Path, checkpointer=None) -> RunResult:
    """Train according to cfg; rank 0 writes metrics.jsonl and prints, also to the job log
    (dtrain.log). Returns the run's figures."""
    with job_log(rt.is_main):
        return _train(cfg, rt, run_dir, checkpointer)


def _train(cfg, rt: Runtime, run_dir: Path, checkpointer) -> RunResult:
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
            f"{rt.world} ranks x {run.plan.grad_accum_steps} accum | run dir {run_dir}"
            + (f" | resumed at step {start_step}" if start_step else "")
        )
    steps = StepLog(run, metrics, view)
    guard = run.guard
    watch = TargetWatch(t, run.flops_per_token)
    t_start = steps.t_first
    val_bpb = math.nan  # the last validation's bits per byte (the summary's)
    try:
        while state.step < t.max_steps:  # a rollback (train.on_nonfinite) sets state.step back
            steps.after_step(*run.train_step(state.step))
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
                if watch.reached({"val_loss": val, "val_bpb": bpb}[watch.figure], state):
                    view.print(f"time to target: {describe_target(state.target)}")
                    last = True
                if not math.isfinite(val) and guard.respond(f"validation loss {val}", run, checkpointer, metrics):
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
            ran=what_ran(rt) if rt.is_main else {},
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
        view.close()
        metrics.close()
        if checkpointer is not None:
            checkpointer.close()


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
