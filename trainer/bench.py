"""Benchmark workers (scripts/bench.py drives them): module level so torchrun's engine can spawn them.

`bench_worker` builds the same `Run` as `dtrain train` and measures, on every rank:

* throughput: the product's own step (`Run.train_step` + the loop's `StepLog` bookkeeping), back
  to back with no added syncs, one host sync at the end; tokens/s over the slowest rank's time.
* a phase split of the same step in separate, instrumented steps (a barrier before each step,
  timers around the loader, forward+backward and the optimizer): data wait, forward+backward with
  gradient sync, optimizer (clip + step; ZeRO's parameter broadcast and FSDP's norm all-reduce
  are in here). Compute is forward+backward of the same number and shape of micro batches on a
  plain, unwrapped replica of the model (same threads and dtype), run just before each
  instrumented step in lockstep on every rank; exposed communication is the synced
  forward+backward minus that (the wrapper's hooks and copies are counted there too).
* memory: peak resident-set growth of the worker from just before the model is built (Linux
  VmHWM, reset through /proc/self/clear_refs; it includes everything the process touched:
  weights, gradients, optimizer state, activations, allocator slack, DDP buckets) or, on CUDA,
  torch.cuda.max_memory_allocated; and the bytes of parameters, gradients (right after the last
  backward) and optimizer state that this rank holds.

`vs_bare_worker` alternates blocks of dtrain steps with blocks of a bare PyTorch loop (the same
GPT, AdamW, batch and tokens; plain DDP when world > 1) in one process and reports both rates.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from trainer.config import from_dict
from trainer.parallel import strategy_class
from trainer.runtime import Runtime, init_runtime

# ------------------------------------------------------------------------------------ memory


def _status_kib() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def reset_peak(device: torch.device) -> bool:
    """Start a new peak-memory window; False when the peak cannot be reset (then it is a bound)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory growth since `start()`: RSS high-water mark on CPU, allocator peak on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _status_kib().get("VmRSS", 0) * 1024
        self.exact = reset_peak(self.device)

    def peak_growth(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status_kib().get("VmHWM", 0) * 1024 - self.base


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    # ZeRO's optimizer exposes its local AdamW's state: this rank's rows only
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- one configuration


def _bookkeeping(run, run_dir: Path):
    """The loop's per-step bookkeeping objects (metrics.jsonl in a scratch dir, no progress bar)."""
    from trainer.loop import StepLog
    from trainer.metrics import MetricsLogger, ProgressView

    metrics = MetricsLogger(run_dir, run.rt.is_main)
    view = ProgressView(False, run.cfg.train.max_steps, 0, bar=False)
    return StepLog(run, metrics, view), metrics


def bench_worker(cfg_dict: dict, steps: int, warmup: int) -> list[dict]:
    """Measure one configuration on this rank; every rank returns the list of all ranks' figures."""
    cfg = from_dict(cfg_dict)
    rt = init_runtime(cfg.train.device, strategy_class(cfg.parallel.mode).needs_process_group,
                      cfg.launch.timeout_s, cfg.launch.threads_per_worker)
    try:
        return rt.all_gather_object(_measure(cfg, rt, steps, warmup))
    finally:
        rt.shutdown()


def _measure(cfg, rt: Runtime, steps: int, warmup: int) -> dict:
    from trainer.loop import Run
    from trainer.optim import lr_at, set_lr

    tmp = Path(tempfile.mkdtemp(prefix="dtrain-bench-"))
    peak = PeakMemory(rt.device)
    peak.start()
    run = Run(cfg, rt, tmp)
    steplog, metrics = _bookkeeping(run, tmp)
    step = 0
    for _ in range(warmup):  # first steps allocate gradients and optimizer state
        steplog.after_step(step, *run.train_step(step))
        step += 1

    # --- throughput: the product's step, back to back -------------------------------------
    rt.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, grad_norm, lr = run.train_step(step)
        steplog.after_step(step, loss, grad_norm, lr)
        step += 1
    rt.all_reduce_mean(loss).item()
    elapsed = time.perf_counter() - t0
    peak_bytes = peak.peak_growth()
    metrics.close()

    # --- phase split (instrumented steps; the barriers are the benchmark's, not the product's) ---
    # Each instrumented product step is paired with the same micro-steps on an unwrapped replica
    # (compute only), run just before it in lockstep on every rank, so drift hits both alike.
    accum = run.plan.grad_accum_steps
    replica = _Replica(cfg, rt, run)
    data_s = fb_s = opt_s = compute_s = 0.0
    grad_bytes = 0
    for i in range(steps + 1):  # the first pair warms the replica (allocations, compile) unmeasured
        batches = [run.train_loader.next_batch() for _ in range(accum)]
        rt.barrier()
        t_replica = replica.step(batches)
        rt.barrier()
        set_lr(run.optimizer, lr_at(step, cfg.optim, cfg.train.max_steps))
        run.model.train()
        data = fb = 0.0
        for micro in range(accum):
            t0 = time.perf_counter()
            x, y = run.train_loader.next_batch()
            _sync(rt.device)
            t1 = time.perf_counter()
            with run.strategy.micro_step(run.model, is_last=micro == accum - 1):
                with run.strategy.autocast():
                    loss = run.forward(x, y)[1]
                (loss / accum).backward()
            _sync(rt.device)
            t2 = time.perf_counter()
            data += t1 - t0
            fb += t2 - t1
        raw = run.strategy.unwrap(run.model)
        grad_bytes = tensor_bytes(p.grad for p in raw.parameters())
        t0 = time.perf_counter()
        run.strategy.clip_grad_norm(run.model, cfg.optim.grad_clip)
        run.strategy.optimizer_step(run.optimizer)
        _sync(rt.device)
        if i:
            opt_s += time.perf_counter() - t0
            data_s, fb_s, compute_s = data_s + data, fb_s + fb, compute_s + t_replica
        step += 1

    raw = run.strategy.unwrap(run.model)
    param_bytes = tensor_bytes(raw.parameters())
    full_param_bytes = sum(p.numel() * p.element_size() for p in raw.parameters())
    optim_bytes = tensor_bytes(optimizer_tensors(run.optimizer))
    n_params = raw.num_params()
    flops_per_token = run.flops_per_token
    del run, raw, replica
    compute_s /= steps

    tokens = steps * cfg.train.micro_batch_size * cfg.train.seq_len * rt.world * accum
    return {
        "rank": rt.rank,
        "threads": torch.get_num_threads() if rt.device.type == "cpu" else None,
        "elapsed_s": elapsed,
        "tokens": tokens,
        "step_s": (data_s + fb_s + opt_s) / steps,
        "data_s": data_s / steps,
        "fwd_bwd_s": fb_s / steps,
        "compute_s": compute_s,
        "comm_s": max(0.0, fb_s / steps - compute_s),
        "optim_s": opt_s / steps,
        "peak_bytes": peak_bytes,
        "peak_exact": peak.exact,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "full_param_bytes": full_param_bytes,
        "n_params": n_params,
        "flops_per_token": flops_per_token,
    }


class _Replica:
    """A plain, unwrapped copy of the model: forward + backward alone (no hooks, no collectives)."""

    def __init__(self, cfg, rt: Runtime, run):
        from trainer.model import build_model

        self.rt, self.autocast = rt, run.strategy.autocast
        self.model = build_model(cfg.model).to(rt.device)
        self.model.activation_checkpointing = cfg.train.activation_checkpointing
        self.model.train()
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model

    def step(self, batches) -> float:
        """Seconds for forward + backward of these micro batches (gradients then dropped)."""
        t0 = time.perf_counter()
        for x, y in batches:
            with self.autocast():
                loss = self.forward(x, y)[1]
            (loss / len(batches)).backward()
        _sync(self.rt.device)
        elapsed = time.perf_counter() - t0
        self.model.zero_grad(set_to_none=True)
        return elapsed


# ------------------------------------------------------------------------------ dtrain vs bare


class _BareLoop:
    """What a hand-written PyTorch loop does: GPT, AdamW (decay on 2-D weights), clip, cosine lr,
    plain DDP when world > 1, and nanoGPT-style batches sliced from the token array in memory."""

    def __init__(self, cfg, rt: Runtime, tokens: np.ndarray, accum: int):
        from trainer.model import build_model

        torch.manual_seed(cfg.train.seed)
        self.cfg, self.rt, self.accum = cfg, rt, accum
        self.model = build_model(cfg.model).to(rt.device)
        self.module = self.model
        if rt.world > 1:
            from torch.nn.parallel import DistributedDataParallel

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
                loss = self.model(x, y)[1]
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
    cfg = from_dict(cfg_dict)
    rt = init_runtime(cfg.train.device, strategy_class(cfg.parallel.mode).needs_process_group,
                      cfg.launch.timeout_s, cfg.launch.threads_per_worker)
    try:
        return rt.all_gather_object(_vs_bare(cfg, rt, rounds, block, warmup))
    finally:
        rt.shutdown()


def _vs_bare(cfg, rt: Runtime, rounds: int, block: int, warmup: int) -> dict:
    from trainer.data.shards import open_split
    from trainer.loop import Run

    tmp = Path(tempfile.mkdtemp(prefix="dtrain-bench-"))
    run = Run(cfg, rt, tmp)
    steplog, metrics = _bookkeeping(run, tmp)
    bare = _BareLoop(cfg, rt, np.concatenate(open_split(cfg.data, "train")), run.plan.grad_accum_steps)
    counters = {"dtrain": 0, "bare": 0}

    def dtrain_block(n):
        for _ in range(n):
            s = counters["dtrain"]
            steplog.after_step(s, *run.train_step(s))
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
            _sync(rt.device)
            seconds[name].append(time.perf_counter() - t0)
    metrics.close()
    return {"rank": rt.rank, "tokens_per_block": block * run.plan.total_batch_size,
            "dtrain_s": seconds["dtrain"], "bare_s": seconds["bare"],
            "threads": torch.get_num_threads() if rt.device.type == "cpu" else None}


# ------------------------------------------------------------------------------ peak memory only


def peak_worker(cfg_dict: dict, steps: int = 3) -> list[dict]:
    """Peak memory growth of `steps` product training steps on this rank (what `dtrain plan`
    estimates); every rank returns all ranks' figures."""
    cfg = from_dict(cfg_dict)
    rt = init_runtime(cfg.train.device, strategy_class(cfg.parallel.mode).needs_process_group,
                      cfg.launch.timeout_s, cfg.launch.threads_per_worker)
    try:
        return rt.all_gather_object(_peak(cfg, rt, steps))
    finally:
        rt.shutdown()


def _peak(cfg, rt: Runtime, steps: int) -> dict:
    from trainer.loop import Run

    peak = PeakMemory(rt.device)
    peak.start()
    run = Run(cfg, rt, Path(tempfile.mkdtemp(prefix="dtrain-bench-")))
    for step in range(steps):
        loss, _, _ = run.train_step(step)
    loss.item()
    return {"rank": rt.rank, "peak_bytes": peak.peak_growth(), "peak_exact": peak.exact}
