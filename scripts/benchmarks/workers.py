"""Benchmark workers for scripts/bench.py's table and for tests/cli/test_plan.py's measured peaks.

`bench_worker` builds the same `Run` as `dtrain train` and measures, on every rank:

* throughput: the product's own step (`Run.train_step` + the loop's `StepLog` bookkeeping), back
  to back with no added syncs, one host sync at the end; tokens/s over the slowest rank's time.
* a phase split of the same step in separate, instrumented steps, each phase the product's own
  method (`Run.forward_backward`, `Run.optimizer_step`) between timers, with a barrier before each
  step and the train loader's `next_batch` timed apart: data wait, forward+backward with gradient
  sync, optimizer (clip, the non-finite check + step; ZeRO's parameter all-gather and FSDP's norm all-reduce are in
  here). Compute is forward+backward of the same number and shape of micro batches on a plain,
  unwrapped replica of the model (same threads and dtype), run just before each instrumented step
  in lockstep on every rank; exposed communication is the synced forward+backward minus that (the
  wrapper's hooks and copies are counted there too).
* memory: peak resident-set growth of the worker from just before the model is built (Linux
  VmHWM, reset through /proc/self/clear_refs; it includes everything the process touched:
  weights, gradients, optimizer state, activations, allocator slack, DDP buckets) or, on CUDA,
  torch.cuda.max_memory_allocated; and the bytes of parameters, gradients (right after the last
  backward) and optimizer state that this rank holds, the latter read from the optimizer's state
  the same way for every mode, with the full (unsharded) optimizer state to compare it with.

`peak_worker` measures only the peak of a few product steps (what `dtrain plan` estimates).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from trainer.fit.run import Run
from trainer.fit.steplog import StepLog
from trainer.model.gpt import build_model
from trainer.optim.schedule import lr_at, set_lr
from trainer.process.runtime import Runtime

from .harness import on_every_rank, step_bookkeeping, sync
from .memory import PeakMemory, optimizer_state_tensors, state_tensors_per_parameter, tensor_bytes

PHASES = ("data_s", "fwd_bwd_s", "compute_s", "optim_s")


def bench_worker(cfg_dict: dict, steps: int, warmup: int) -> list[dict]:
    """Measure one configuration on this rank; every rank returns the list of all ranks' figures."""
    return on_every_rank(cfg_dict, _measure, steps, warmup)


def peak_worker(cfg_dict: dict, steps: int = 3) -> list[dict]:
    """Peak memory growth of `steps` product training steps on this rank (what `dtrain plan`
    estimates); every rank returns all ranks' figures."""
    return on_every_rank(cfg_dict, _peak, steps)


def _measure(cfg, rt: Runtime, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as run_dir:
        peak = PeakMemory(rt.device)
        peak.start()
        run = Run(cfg, rt, Path(run_dir))
        steplog, metrics = step_bookkeeping(run, Path(run_dir))
        for step in range(warmup):  # first steps allocate gradients and optimizer state
            steplog.after_step(*run.train_step(step))
        elapsed = _throughput(run, steplog, first_step=warmup, steps=steps)
        peak_bytes = peak.peak_growth()
        metrics.close()
        phases = _phase_split(run, first_step=warmup + steps, steps=steps)
        held = _held_bytes(run)
        tokens = steps * run.plan.total_batch_size
        del run

    data_s, fwd_bwd_s, compute_s, optim_s = (phases[key] / steps for key in PHASES)
    return {
        "rank": rt.rank,
        "threads": torch.get_num_threads() if rt.device.type == "cpu" else None,
        "elapsed_s": elapsed,
        "tokens": tokens,
        "step_s": data_s + fwd_bwd_s + optim_s,
        "data_s": data_s,
        "fwd_bwd_s": fwd_bwd_s,
        "compute_s": compute_s,
        "comm_s": max(0.0, fwd_bwd_s - compute_s),
        "optim_s": optim_s,
        "peak_bytes": peak_bytes,
        "peak_exact": peak.exact,
        "grad_bytes": phases["grad_bytes"],
        **held,
    }


def _throughput(run: Run, steplog: StepLog, first_step: int, steps: int) -> float:
    """Seconds for `steps` product steps back to back, as the loop runs them (no added syncs)."""
    run.rt.barrier()
    t0 = time.perf_counter()
    for step in range(first_step, first_step + steps):
        loss, grad_norm, lr = run.train_step(step)
        steplog.after_step(loss, grad_norm, lr)
    run.rt.all_reduce_mean(loss).item()
    return time.perf_counter() - t0


def _phase_split(run: Run, first_step: int, steps: int) -> dict:
    """Seconds per phase summed over `steps` instrumented product steps (after one unmeasured pair
    that warms the replica), and the gradient bytes held right after the last backward.

    Each step is `Run.train_step`'s parts called one by one: the scheduled lr, `forward_backward`
    (reading through a loader that times its own wait) and `optimizer_step`. Each is paired with
    the same micro-steps on an unwrapped replica (compute only), run just before it in lockstep
    on every rank, so drift hits both alike. The barriers are the benchmark's, not the product's."""
    rt, cfg = run.rt, run.cfg
    accum = run.plan.grad_accum_steps
    replica = _Replica(run)
    loader = _TimedLoader(run.train_loader, rt.device)
    run.train_loader = loader
    totals = dict.fromkeys(PHASES, 0.0)
    grad_bytes = 0
    try:
        for i in range(steps + 1):
            step = first_step + i
            batches = [loader.inner.next_batch() for _ in range(accum)]
            rt.barrier()
            compute = replica.step(batches)
            rt.barrier()
            set_lr(run.optimizer, lr_at(step, cfg.optim, cfg.train.max_steps))
            loader.waited = 0.0
            t0 = time.perf_counter()
            loss = run.forward_backward()
            sync(rt.device)
            t1 = time.perf_counter()
            grad_bytes = tensor_bytes(p.grad for p in run.strategy.unwrap(run.model).parameters())
            t2 = time.perf_counter()
            run.optimizer_step(loss)
            sync(rt.device)
            t3 = time.perf_counter()
            if i:
                totals["data_s"] += loader.waited
                totals["fwd_bwd_s"] += t1 - t0 - loader.waited
                totals["compute_s"] += compute
                totals["optim_s"] += t3 - t2
    finally:
        run.train_loader = loader.inner
    return {**totals, "grad_bytes": grad_bytes}


def _held_bytes(run: Run) -> dict:
    """Bytes of parameters and optimizer state this rank holds, the full (unsharded) sizes to
    compare them with, and the model's size."""
    raw = run.strategy.unwrap(run.model)
    full_param_bytes = sum(p.numel() * p.element_size() for p in raw.parameters())
    return {
        "param_bytes": tensor_bytes(raw.parameters()),
        "full_param_bytes": full_param_bytes,
        "optim_bytes": tensor_bytes(optimizer_state_tensors(run.optimizer)),
        # unsharded, the optimizer keeps this many parameter-sized tensors per parameter
        "full_optim_bytes": full_param_bytes * state_tensors_per_parameter(run.optimizer),
        "n_params": raw.num_params(),
        "flops_per_token": run.flops_per_token,
    }


class _TimedLoader:
    """The run's train loader with each `next_batch` timed (the device synced on both sides, so
    the wait is the loader's own and no earlier compute lands in it)."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.device, self.waited = inner, device, 0.0

    def next_batch(self):
        sync(self.device)
        t0 = time.perf_counter()
        batch = self.inner.next_batch()
        sync(self.device)
        self.waited += time.perf_counter() - t0
        return batch

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _Replica:
    """A plain, unwrapped copy of the model: forward + backward alone (no hooks, no collectives)."""

    def __init__(self, run: Run):
        cfg = run.cfg
        self.device, self.autocast = run.rt.device, run.strategy.autocast
        self.model = build_model(cfg.model).to(self.device)
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
        sync(self.device)
        elapsed = time.perf_counter() - t0
        self.model.zero_grad(set_to_none=True)
        return elapsed


def _peak(cfg, rt: Runtime, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as run_dir:
        peak = PeakMemory(rt.device)
        peak.start()
        run = Run(cfg, rt, Path(run_dir))
        for step in range(steps):
            loss, _, _ = run.train_step(step)
        loss.item()
        peak_bytes = peak.peak_growth()
        del run
    return {"rank": rt.rank, "peak_bytes": peak_bytes, "peak_exact": peak.exact}
