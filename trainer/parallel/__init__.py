"""Parallelism modes behind one interface (see base.Strategy).

A mode is one module here (a Strategy subclass with its `name`) and one YAML in conf/parallel/:
the classes are found by importing this package's modules, so adding a mode changes nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from trainer.parallel.base import Strategy


def _discover() -> dict[str, type[Strategy]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Strategy]] = {}
    pending = [Strategy]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ != f"{__name__}.base":
            found[cls.name] = cls
    return found


STRATEGIES: dict[str, type[Strategy]] = _discover()


def strategy_class(mode: str) -> type[Strategy]:
    return STRATEGIES[mode]


def make_strategy(parallel_cfg, train_cfg, runtime, training: bool = True) -> Strategy:
    """The mode's Strategy for this worker; `training=False` for work that needs no synchronised
    replicas (evaluation), where a mode such as parallel=none may run at world > 1."""
    cls = STRATEGIES[parallel_cfg.mode]
    cls.check_world(runtime.world, training=training)
    return cls(parallel_cfg, train_cfg, runtime)
