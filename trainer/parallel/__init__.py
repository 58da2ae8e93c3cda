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


def make_strategy(parallel_cfg, train_cfg, runtime) -> Strategy:
    return STRATEGIES[parallel_cfg.mode](parallel_cfg, train_cfg, runtime)
