"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2), dtrain's
own: torch has no Lion, and these few lines keep it offline and free of a dependency.

Per parameter p with gradient g and momentum m (the one state tensor, `exp_avg`; AdamW keeps two):

    p <- p * (1 - lr * weight_decay)                    decoupled weight decay, as AdamW's
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)     every element moves by exactly lr
    m <- beta2 * m + (1 - beta2) * g

Every operation is elementwise, so a parameter's rows (ZeRO-1) or a DTensor shard (FSDP) step
exactly as the whole tensor would: each parallel mode runs it as it runs AdamW.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0):
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion's betas must be in [0, 1), not {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                if decay:
                    param.mul_(1 - lr * decay)
                # lerp(m, g, 1 - beta) is beta * m + (1 - beta) * g
                param.add_(momentum.lerp(param.grad, 1 - beta1).sign_(), alpha=-lr)
                momentum.lerp_(param.grad, 1 - beta2)
        return loss
