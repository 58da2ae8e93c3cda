"""parallel=ddp: DistributedDataParallel, one process per device."""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from trainer.parallel.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    needs_process_group = True
    syncs_replicas = True
    keeps_gradient_buckets = True  # wrap() sets gradient_as_bucket_view

    def wrap(self, model):
        model = model.to(self.rt.device)
        device_ids = [self.rt.device.index] if self.rt.device.type == "cuda" else None
        # Gradients are all-reduced bucket by bucket as backward produces them, so
        # communication overlaps the rest of backward.
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )

    def unwrap(self, model):
        return model.module

    def micro_step(self, model, is_last):
        # Accumulating micro-steps skip the all-reduce; the last one syncs the summed gradient.
        return contextlib.nullcontext() if is_last else model.no_sync()
