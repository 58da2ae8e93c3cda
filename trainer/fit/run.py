"""What one worker builds for training (Run: model, strategy, optimizer, loaders, validation sets)
and what it does with them: one optimizer step, validation, a sample. trainer/fit/loop.py's
Trainer steps it; benchmarks time these very methods."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.config.batch import BatchPlan, batch_plan
from trainer.data.loader import ShardLoader
from trainer.data.mix_loader import MixtureLoader
from trainer.data.mixture import mixed_figures, mixture_weights, source_configs
from trainer.data.shard_reader import open_split, redo_command
from trainer.data.val_set import ValidationSet
from trainer.evals.generate import generate_text
from trainer.fit.experts import ExpertStats
from trainer.fit.nonfinite import NonFiniteGuard
from trainer.model.float8 import convert_float8, resolve_float8
from trainer.model.gpt import build_model
from trainer.model.layers import use_attention
from trainer.model.loss import resolve_loss_kernel
from trainer.observe.stragglers import StragglerWatch
from trainer.optim.build import build_optimizer, masks_on_device
from trainer.optim.schedule import lr_at, set_lr
from trainer.parallel import make_strategy
from trainer.process.hang_watch import StepProgress, injected_delay
from trainer.process.joblog import say
from trainer.process.runtime import Runtime
from trainer.tokenizers.load import load_tokenizer


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
    target: dict | None = None  # train.target_val_loss's record once reached (trainer/fit/target.py)



class Run:
    """Everything one worker builds for training: model, strategy, optimizer, loaders, logger."""

    def __init__(self, cfg, rt: Runtime, run_dir: Path):
        self.cfg, self.rt, self.run_dir = cfg, rt, run_dir
        self.plan: BatchPlan = batch_plan(cfg, rt.world)  # counts rt.dp_world's ranks
        # The same seed on every rank: replicas start identical without a broadcast.
        torch.manual_seed(cfg.train.seed)
        if rt.device.type == "cuda":
            # TF32 tensor cores for the fp32 matmuls left outside autocast (bf16 does the rest).
            torch.set_float32_matmul_precision("high")
        self.tokenizer = load_tokenizer(cfg.tokenizer)  # its vocabulary bounds the loaders' ids
        self.strategy = make_strategy(cfg.parallel, cfg.train, rt)
        raw_model = build_model(cfg.model)
        raw_model.activation_checkpointing = cfg.train.activation_checkpointing
        # float8 before the strategy wraps the model (FSDP, DDP) and before torch.compile
        float8 = resolve_float8(cfg.train.float8, rt.device)
        self.float8_layers = convert_float8(raw_model, float8, rt.device)
        raw_model.loss_chunks = cfg.train.loss_chunks
        raw_model.loss_kernel = resolve_loss_kernel(cfg.train.loss_kernel, cfg.train.loss_chunks, rt.device)
        use_attention(raw_model, cfg.model.attention)
        # What the run computes with where a key offers several kernels (its provenance records them).
        self.kernels = {"attention": cfg.model.attention, "loss": raw_model.loss_kernel,
                        "float8": f"{float8} ({len(self.float8_layers)} layers)" if float8 != "off" else "off"}
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
        # where the step in progress has got to, for a hang's report (trainer/process/hang_watch.py)
        self.progress = StepProgress(micros=self.plan.grad_accum_steps)
        self.delay = injected_delay()  # a testing hook (trainer/process/hang_watch.py) or None
        self.read_s = 0.0  # this rank's seconds reading batches (the straggler watch's)
        self.flops_per_token = self.strategy.unwrap(self.model).flops_per_token(cfg.train.seq_len)
        # a MoE model's aux loss and expert load (trainer/fit/experts.py); None for a dense model
        self.experts = ExpertStats.of(self.strategy.unwrap(self.model), rt)
        # each rank's own time in a sampled step, compared across ranks (trainer/observe/stragglers.py)
        self.stragglers = StragglerWatch(cfg, rt, lambda: self.read_s)

    def _val_set(self, data) -> ValidationSet:
        """The first train.val_tokens tokens of the val split (trainer/data/val_set.py), or as many
        as it holds (rank 0 says so)."""
        t = self.cfg.train
        what = f"val split of dataset {data.name!r}"
        val = ValidationSet(open_split(data, "val"), t.val_tokens, t.micro_batch_size, t.seq_len, self.rt.dp_rank,
                            self.rt.dp_world, self.rt.device, self.tokenizer.vocab_size, what, redo_command(data))
        if val.sequences < val.wanted and self.rt.is_main:
            say(f"the {what} holds {val.sequences:,} sequences of seq_len {t.seq_len} ({val.tokens:,} tokens), "
                f"fewer than train.val_tokens={t.val_tokens:,} asks: validation scores them all")
        return val

    def _mixture_loader(self, sources: dict) -> MixtureLoader:
        t = self.cfg.train
        return MixtureLoader({name: open_split(data, "train") for name, data in sources.items()}, self.mix_weights,
                             t.micro_batch_size, t.seq_len, self.rt.dp_rank, self.rt.dp_world,
                             self.plan.grad_accum_steps, t.seed, self.rt.device, vocab_size=self.tokenizer.vocab_size,
                             redo={name: redo_command(data) for name, data in sources.items()})

    def _loader(self, data) -> ShardLoader:
        t = self.cfg.train
        return ShardLoader(
            open_split(data, "train"),
            t.micro_batch_size,
            t.seq_len,
            self.rt.dp_rank,  # ranks of one tensor-parallel group read the same batch
            self.rt.dp_world,
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
        self.progress.step = step + 1
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
        DTRAIN_INJECT_NONFINITE (trainer/fit/nonfinite.py) makes the loss NaN."""
        if not self.strategy.unwrap(self.model).training:
            # Only after an evaluation: train() rewrites every module's `training` attribute, and
            # torch.compile's guards then re-check each module's state on the next call (the
            # compiled step's host time grows by it, every step)
            self.model.train()
        accum = self.plan.grad_accum_steps
        loss_sum = torch.zeros((), device=self.rt.device)
        progress = self.progress
        for micro in range(accum):
            progress.at(micro, 0)
            reading = time.perf_counter()
            if micro == 0 and self.delay and self.delay.applies(self.rt.rank, progress.step):
                time.sleep(self.delay.seconds)
            x, y = self.train_loader.next_batch()
            self.read_s += time.perf_counter() - reading
            progress.at(micro, 1)
            with self.strategy.micro_step(self.model, is_last=micro == accum - 1):
                with self.strategy.autocast():
                    # Only the loss: holding the logits (B x T x vocab) through backward would keep
                    # the largest activation alive for nothing.
                    loss = self.forward(x, y)[1]
                    if poison:
                        loss = loss * math.nan
                progress.at(micro, 2)
                # Each micro-step's gradient is 1/accum of the step's mean-loss gradient.
                (loss / accum).backward()
            loss_sum += loss.detach()
            if self.experts is not None:
                self.experts.after_micro_step()
        return loss_sum / accum

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the gradients, check the step on every rank (trainer/fit/nonfinite.py) and update the
        weights only when it is finite (else drop the gradients): masked on device where the
        optimizer can, so no host sync comes before the update. Returns (mean loss over all ranks,
        gradient norm before clipping)."""
        self.progress.at(self.plan.grad_accum_steps - 1, 3)
        self.strategy.reduce_gradients(self.model)
        grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        # a MoE model's aux loss and a sampled step's straggler figures ride the check's all-reduce
        # (trainer/fit/experts.py, trainer/observe/stragglers.py)
        aux = None if self.experts is None else self.experts.step_aux(self.plan.grad_accum_steps)
        timing = self.stragglers.rider(loss.device)
        riders = [part.reshape(-1) for part in (aux, timing) if part is not None]
        loss, found_inf = self.guard.check(loss, grad_norm, on_device=self.masks_on_device,
                                           beside=torch.cat(riders) if riders else None)
        if found_inf is not None:
            # The update is masked on device; the verdict is read once it is queued.
            self.strategy.optimizer_step(self.optimizer, found_inf)
            self.guard.settle()
        elif self.guard.finite:
            self.strategy.optimizer_step(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        beside = self.guard.beside
        if self.experts is not None:
            self.experts.aux_loss, beside = beside[0], beside[1:]
        if timing is not None:
            self.stragglers.arrived(beside)
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
