"""Parallelism modes behind one interface (see base.Strategy)."""

from trainer.parallel.base import Strategy
from trainer.parallel.ddp import DDPStrategy
from trainer.parallel.dp import DataParallelStrategy
from trainer.parallel.fsdp import FSDPStrategy
from trainer.parallel.single import SingleStrategy
from trainer.parallel.zero import ZeroStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "none": SingleStrategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "zero": ZeroStrategy,
    "fsdp": FSDPStrategy,
}


def strategy_class(mode: str) -> type[Strategy]:
    return STRATEGIES[mode]


def make_strategy(parallel_cfg, train_cfg, runtime) -> Strategy:
    return STRATEGIES[parallel_cfg.mode](parallel_cfg, train_cfg, runtime)
