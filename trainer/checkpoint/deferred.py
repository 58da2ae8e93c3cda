"""torch.distributed.checkpoint and the checks around it (verify.py), imported at the first save,
restore or weights read rather than with the modules that use them (manager, selection,
trainer/weights/): DCP pulls in DTensor and sympy, about 0.7 s, which a one-process run needs for nothing
before its first save (tests/system/test_startup.py). trainer/parallel/base.py, a layer below, defers DCP's
state-dict helpers the same way.
"""

from __future__ import annotations

import warnings

# DCP warns on every single-process save and load (an async one warns from its thread); that is
# the intended use here. Process-wide, and installed here because every module that saves or
# loads with DCP (manager, selection, trainer/weights/) imports this one, before DCP itself.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")


def dcp():
    """torch.distributed.checkpoint."""
    import torch.distributed.checkpoint  # deferred: heavy (see the module's docstring)

    return torch.distributed.checkpoint


def verify():
    """trainer.checkpoint.verify (DCP's index read safely, the checks before a load)."""
    from trainer.checkpoint import verify  # deferred: imports torch.distributed.checkpoint

    return verify
