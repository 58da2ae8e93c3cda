"""TensorBoard event files beside metrics.jsonl (optional extra: pip install 'dtrain[tensorboard]')."""

from __future__ import annotations

from pathlib import Path

from trainer.errors import ConfigError


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "logger=tensorboard needs the tensorboard package; run pip install 'dtrain[tensorboard]' "
            "or use logger=jsonl"
        ) from None


def open_writer(run_dir: Path, purge_step: int | None):
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    # purge_step drops events past a resumed step, as metrics.jsonl does.
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
