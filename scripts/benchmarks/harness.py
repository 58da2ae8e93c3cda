"""What every benchmark worker does around its measurement, and the loop's bookkeeping it times."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from trainer.config.schema import from_dict
from trainer.fit.run import Run
from trainer.fit.steplog import StepLog
from trainer.observe.metrics import MetricsLogger, ProgressView
from trainer.parallel import strategy_class
from trainer.process.runtime import init_runtime


def on_every_rank(cfg_dict: dict, measure: Callable[..., dict], *args) -> list[dict]:
    """Bring this worker up as dtrain does (device, threads, process group when the mode needs
    one), run `measure(cfg, rt, *args)` and return every rank's result in rank order, on every
    rank. The measurement's objects are freed before the process group goes (as in `dtrain eval`)."""
    cfg = from_dict(cfg_dict)
    rt = init_runtime(cfg.train.device, strategy_class(cfg.parallel.mode).needs_process_group,
                      cfg.launch.timeout_s, cfg.launch.threads_per_worker)
    try:
        return rt.all_gather_object(measure(cfg, rt, *args))
    finally:
        rt.shutdown()


def step_bookkeeping(run: Run, run_dir: Path) -> tuple[StepLog, MetricsLogger]:
    """The loop's per-step bookkeeping objects (metrics.jsonl in `run_dir`, no progress bar)."""
    metrics = MetricsLogger(run_dir, run.rt.is_main)
    view = ProgressView(False, run.cfg.train.max_steps, 0, bar=False)
    return StepLog(run, metrics, view), metrics


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a host timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
