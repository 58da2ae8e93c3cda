"""The one interface every parallelism mode implements; the train loop knows nothing else."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from trainer.model import GPT
from trainer.optim import build_adamw
from trainer.runtime import Runtime


class Strategy:
    """Single-process behaviour; each mode overrides only what it changes."""

    name = "none"
    needs_process_group = False

    def __init__(self, parallel_cfg, train_cfg, runtime: Runtime):
        self.cfg = parallel_cfg
        self.train_cfg = train_cfg
        self.rt = runtime

    # --- model and optimizer -------------------------------------------------------------
    def wrap(self, model: GPT) -> nn.Module:
        """Put the model on its device and wrap it for this mode."""
        return model.to(self.rt.device)

    def unwrap(self, model: nn.Module) -> GPT:
        """The GPT inside the wrapper (for inference and for names in checkpoints)."""
        return model

    def build_optimizer(self, model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
        return build_adamw(model, optim_cfg, self.rt.device)

    # --- one optimizer step ----------------------------------------------------------------
    def micro_step(self, model: nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-step's forward and backward; gradients sync only on the last."""
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = compute_dtype(self.train_cfg.dtype, self.rt.device)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=dtype)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over all gradients and return that norm (before clipping)."""
        # max_norm=inf measures the norm without clipping (optim.grad_clip=0).
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # --- inference ------------------------------------------------------------------------
    def inference_model(self, model: nn.Module) -> nn.Module:
        """The module to run evaluation forwards on (every rank calls it the same number of times)."""
        return self.unwrap(model)

    def describe(self) -> str:
        return self.name


def compute_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]
