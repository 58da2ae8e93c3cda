"""dtrain's step against a bare PyTorch loop, in the same worker (`scripts/bench.py --vs-bare`).

`vs_bare_worker` alternates blocks of dtrain steps (`Run.train_step` + the loop's `StepLog` and its
stop-signal check at the step boundary) with
blocks of a hand-written loop (the same GPT, AdamW, batch and tokens; plain DDP when world > 1)
in one process and reports both rates, round by round.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.data.shard_reader import open_split
from trainer.fit.run import Run
from trainer.model.gpt import build_model
from trainer.process.runtime import Runtime
from trainer.process.signals import StopSignals, at_step_boundary

from .harness import on_every_rank, step_bookkeeping, sync


class BareLoop:
    """What a hand-written PyTorch loop does (build-nanogpt's): GPT, AdamW (decay on 2-D weights;
    fused on CUDA), bf16 autocast on CUDA, torch.compile when train.compile, clip, cosine lr,
    plain DDP when world > 1, and nanoGPT-style batches sliced from the token array in memory."""

    def __init__(self, cfg, rt: Runtime, tokens: np.ndarray, accum: int):
        torch.manual_seed(cfg.train.seed)
        self.cfg, self.rt, self.accum = cfg, rt, accum
        self.model = build_model(cfg.model).to(rt.device)
        self.module = self.model
        if rt.world > 1:
            ids = [rt.device.index] if rt.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=ids)
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=rt.device.type == "cuda",
        )
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.B, self.T = cfg.train.micro_batch_size, cfg.train.seq_len
        self.pos = self.B * self.T * rt.rank
        self.amp = rt.device.type == "cuda"
        # build-nanogpt compiles its model too when the run does (train.compile)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model

    def batch(self):
        B, T = self.B, self.T
        if self.pos + B * T * self.rt.world + 1 > len(self.tokens):
            self.pos = B * T * self.rt.rank
        buf = self.tokens[self.pos : self.pos + B * T + 1]
        self.pos += B * T * self.rt.world
        x, y = buf[:-1].view(B, T), buf[1:].view(B, T)
        if self.rt.device.type == "cuda":
            return x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True)
        return x, y

    def lr(self, step: int) -> float:
        o, max_steps = self.cfg.optim, self.cfg.train.max_steps
        if step < o.warmup_steps:
            return o.lr * (step + 1) / o.warmup_steps
        ratio = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
        return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)

    def step(self, step: int) -> torch.Tensor:
        loss_accum = torch.zeros((), device=self.rt.device)
        for micro in range(self.accum):
            x, y = self.batch()
            if self.rt.world > 1:
                self.model.require_backward_grad_sync = micro == self.accum - 1
            with torch.autocast(self.rt.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = self.forward(x, y)[1]
            (loss / self.accum).backward()
            loss_accum += loss.detach()
        clip = self.cfg.optim.grad_clip
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip if clip > 0 else float("inf"))
        lr = self.lr(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_accum / self.accum


def vs_bare_worker(cfg_dict: dict, rounds: int, block: int, warmup: int) -> list[dict]:
    """Both loops' seconds per block, round by round, on this rank; every rank returns all ranks'."""
    return on_every_rank(cfg_dict, _vs_bare, rounds, block, warmup)


def _vs_bare(cfg, rt: Runtime, rounds: int, block: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as run_dir:
        run = Run(cfg, rt, Path(run_dir))
        steplog, metrics = step_bookkeeping(run, Path(run_dir))
        bare = BareLoop(cfg, rt, np.concatenate(open_split(cfg.data, "train")), run.plan.grad_accum_steps)
        counters = {"dtrain": 0, "bare": 0}
        stop = StopSignals(rt.rank).install()  # the loop's per-step agreement on stop signals is timed too

        def dtrain_block(n):
            for _ in range(n):
                s = counters["dtrain"]
                steplog.after_step(*run.train_step(s))
                at_step_boundary(run, None)
                counters["dtrain"] += 1

        def bare_block(n):
            loss = None
            for _ in range(n):
                loss = bare.step(counters["bare"])
                counters["bare"] += 1
            loss.item()

        blocks = {"dtrain": dtrain_block, "bare": bare_block}
        for fn in blocks.values():
            fn(warmup)
        seconds = {"dtrain": [], "bare": []}  # per round, so a load spike spoils one round, not the figure
        for r in range(rounds):
            order = ("dtrain", "bare") if r % 2 == 0 else ("bare", "dtrain")
            for name in order:
                rt.barrier()
                t0 = time.perf_counter()
                blocks[name](block)
                sync(rt.device)
                seconds[name].append(time.perf_counter() - t0)
        metrics.close()
        stop.uninstall(clean=True)
        tokens_per_block = block * run.plan.total_batch_size
    return {"rank": rt.rank, "tokens_per_block": tokens_per_block,
            "dtrain_s": seconds["dtrain"], "bare_s": seconds["bare"],
            "threads": torch.get_num_threads() if rt.device.type == "cpu" else None}
