"""parallel=none: one process, one device."""

from trainer.parallel.base import Strategy


class SingleStrategy(Strategy):
    name = "none"
    tensor_parallel = True
