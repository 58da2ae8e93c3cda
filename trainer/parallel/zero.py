"""parallel=zero: DDP plus ZeroRedundancyOptimizer (each rank keeps 1/world of AdamW's state)."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from trainer.optim import adamw_kwargs, param_groups
from trainer.parallel.ddp import DDPStrategy


class ZeroStrategy(DDPStrategy):
    name = "zero"

    def build_optimizer(self, model, optim_cfg):
        groups = param_groups(model, optim_cfg.weight_decay)
        # ZeroRedundancyOptimizer takes the first group at construction and the rest through
        # add_param_group, which keeps each group's weight decay.
        optimizer = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=torch.optim.AdamW,
            weight_decay=groups[0]["weight_decay"],
            **adamw_kwargs(optim_cfg, self.rt.device),
        )
        for group in groups[1:]:
            optimizer.add_param_group(group)
        return optimizer
