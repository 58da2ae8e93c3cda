"""parallel=dp: nn.DataParallel, one process driving every visible GPU."""

from __future__ import annotations

import torch
import torch.nn as nn
from rich.console import Console

from trainer.parallel.base import Strategy


class DataParallelStrategy(Strategy):
    name = "dp"
    one_process_many_devices = True

    def __init__(self, parallel_cfg, train_cfg, runtime):
        super().__init__(parallel_cfg, train_cfg, runtime)
        self.n_devices = torch.cuda.device_count() if runtime.device.type == "cuda" else 0

    def wrap(self, model):
        model = model.to(self.rt.device)
        if self.n_devices < 2:
            Console(stderr=True).print(
                f"[yellow]parallel=dp: {self.n_devices} GPU(s) visible, running as one device[/]"
            )
            return model
        # DataParallel scatters each micro batch across the GPUs and gathers the losses on
        # the first one; the loss is then a vector, averaged by mean_loss below.
        return _MeanLossDataParallel(model)

    def unwrap(self, model):
        return model.module if isinstance(model, nn.DataParallel) else model


class _MeanLossDataParallel(nn.DataParallel):
    """DataParallel whose forward returns one mean loss, like the bare model does."""

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, None if loss is None else loss.mean()
