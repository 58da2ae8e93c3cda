"""Python's garbage collector paused while torch is imported.

Importing torch, torch._dynamo and dtrain's torch side makes hundreds of thousands of long-lived
objects (modules, functions, classes), and every few hundred new ones start a collection of the
young objects, and more and more of them one over the whole growing heap. None of it is garbage. So
the collector is off for the import, and what the import made is then frozen (gc.freeze: moved
where no later collection walks it again) before the collector is on again. docs/performance.md
("Imports without the garbage collector") has the launches' CPU both ways.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside (unless it already was), everything alive at the end frozen."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_on:
            gc.enable()


def resume_collector() -> None:
    """The end of a pause begun elsewhere (a forkserver's preload, before the fork): everything alive
    frozen, then the collector on."""
    gc.freeze()
    gc.enable()
