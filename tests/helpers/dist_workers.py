"""Worker functions the distributed tests launch through torchrun's engine (must be importable)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.config.batch import mesh_shape, requested_world
from trainer.config.schema import from_dict
from trainer.fit.run import Run
from trainer.parallel import strategy_class
from trainer.process.runtime import init_runtime


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def train_and_inspect(cfg_dict: dict, run_dir: str, steps: int) -> dict:
    """Train a few steps, then report this rank's weights digest and what it holds in memory."""
    cfg = from_dict(cfg_dict)
    # the run's own mesh (parallel.dp_replicate, parallel.tp), as trainer/fit/worker.py lays it out
    rt = init_runtime("cpu", strategy_class(cfg.parallel.mode).needs_process_group, 120, 1,
                      shape=mesh_shape(cfg, requested_world(cfg)))
    try:
        run = Run(cfg, rt, Path(run_dir))
        for step in range(steps):
            run.train_step(step)
        run.forward_backward()  # live gradients to measure (the optimizer step drops its own); weights unchanged
        raw = run.strategy.unwrap(run.model)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in raw.named_parameters()}
        digest = hashlib.sha256(b"".join(full[n].numpy().tobytes() for n in sorted(full))).hexdigest()
        # ZeRO's optimizer state is its local AdamW's (`optim`): this rank's rows (zero) or whole
        # parameters (zero_torch) only
        local = getattr(run.optimizer, "optim", run.optimizer)
        state = [t for s in local.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        return {
            "digest": digest,
            "param_bytes": _bytes(raw.parameters()),
            "grad_bytes": _bytes(p.grad for p in raw.parameters() if p.grad is not None),
            "optimizer_bytes": _bytes(state),
            "full_param_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        }
    finally:
        rt.shutdown()


def val_figures_on_weights(cfg_dicts: list[dict], run_dir: str, weights: str) -> list[dict]:
    """Validation figures of each config's Run on the same saved weights (a raw GPT state dict)."""
    first = from_dict(cfg_dicts[0])
    rt = init_runtime("cpu", strategy_class(first.parallel.mode).needs_process_group, 120, 1)
    try:
        figures = []
        for cfg_dict in cfg_dicts:
            run = Run(from_dict(cfg_dict), rt, Path(run_dir))
            run.strategy.unwrap(run.model).load_state_dict(torch.load(weights))
            figures.append(run.val_figures())
        return figures
    finally:
        rt.shutdown()
