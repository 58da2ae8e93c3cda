"""Helpers several test modules share (issue 35: a test module imports helpers, not another test
module). Each builds real state with dtrain's own code, in this process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.checkpoint.manager import Checkpointer
from trainer.compose import compose
from trainer.config import batch_plan
from trainer.loop import TrainState
from trainer.model import build_model
from trainer.optim.build import build_optimizer
from trainer.parallel import make_strategy
from trainer.runtime import Runtime

ONE_CPU_PROCESS = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"),
                          distributed=False)


def one_process_optimizer(model: torch.nn.Module, cfg):
    """cfg.optim's optimizer for `model` as parallel=none runs it in one CPU process."""
    return build_optimizer(model, cfg.optim, make_strategy(cfg.parallel, cfg.train, ONE_CPU_PROCESS))


class _LoaderAtStart:
    """What the Checkpointer records of a data loader that has not moved."""

    def state_dict(self):
        return {"epoch": 0, "shard_pos": 0, "token_offset": 0}


def checkpointed_tiny_run(run_dir: Path, overrides: list[str], steps: int, tokens_per_step: int):
    """A tiny GPT trained `steps` AdamW steps on random tokens in this process and checkpointed by
    the real Checkpointer into run_dir; returns (the composed config, the live model)."""
    cfg = compose(["model=tiny", "train.device=cpu", *overrides])
    torch.manual_seed(0)
    strategy = make_strategy(cfg.parallel, cfg.train, ONE_CPU_PROCESS)
    model = strategy.wrap(build_model(cfg.model))
    optimizer = build_optimizer(model, cfg.optim, strategy)
    for _ in range(steps):
        x = torch.randint(0, 50257, (2, 16))
        model(x, torch.roll(x, -1, 1))[1].backward()
        strategy.optimizer_step(optimizer)
    run = SimpleNamespace(strategy=strategy, model=model, optimizer=optimizer, train_loader=_LoaderAtStart(),
                          state=TrainState(step=steps, tokens=tokens_per_step * steps), plan=batch_plan(cfg, 1))
    checkpointer = Checkpointer(cfg, ONE_CPU_PROCESS, run_dir)
    checkpointer.save(run)
    checkpointer.close()
    return cfg, model
