"""A checkpoint's weights in a plain GPT, without a training run: for eval, sample and export.

The load is local to this process (no collectives): a checkpoint written by any mode at any world
size loads here, with or without a process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint.deferred import dcp, verify
from trainer.checkpoint.finite import describe_nonfinite, nonfinite_tensors
from trainer.checkpoint.integrity import CorruptCheckpoint
from trainer.checkpoint.layout import (
    CHECKPOINT_DIR,
    checkpoint_step,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    step_dir_name,
)
from trainer.checkpoint.records import read_checkpoint_config
from trainer.checkpoint.selection import newest_intact
from trainer.checkpoint.tokenizer_copy import checkpoint_tokenizer
from trainer.config.schema import from_dict
from trainer.errors import CheckpointError
from trainer.io import dotted_keys, first_line
from trainer.model.gpt import build_model
from trainer.parallel.base import tied_aliases
from trainer.tokenizers.load import load_tokenizer


def load_model_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Load a checkpoint's full weights into a plain (unwrapped) GPT in this process, once every
    file matches its recorded checksum (a corrupt checkpoint is refused, naming an intact one)."""
    ckpt_dir = Path(ckpt_dir)
    checks = verify()  # DCP only now: `dtrain eval`'s checks, and their errors, come without it
    try:
        checks.verify_files(ckpt_dir)
        metadata = checks.read_metadata(ckpt_dir)
        checks.check_files(ckpt_dir, metadata)
    except CorruptCheckpoint as err:
        raise _refused(err, ckpt_dir) from None
    aliases = tied_aliases(model)
    template = {k: v for k, v in model.state_dict().items() if k not in aliases}
    checks.check_template(ckpt_dir, metadata, dotted_keys({"model": template}))
    try:
        dcp().load({"model": template}, storage_reader=checks.SafeReader(ckpt_dir), no_dist=True)
    except CheckpointError:
        raise
    except checks.DCP_ERRORS as err:
        raise CheckpointError(f"checkpoint {ckpt_dir} could not be read: {first_line(err)}") from None
    model.load_state_dict({**template, **{a: template[n] for a, n in aliases.items()}})
    _check_finite(model, ckpt_dir)


def _refused(err: CorruptCheckpoint, ckpt_dir: Path) -> CheckpointError:
    """A corrupt checkpoint's one line, naming the newest intact one beside it."""
    root = ckpt_dir.parent if checkpoint_step(ckpt_dir) is not None else ckpt_dir / CHECKPOINT_DIR
    intact = newest_intact(root, exclude=ckpt_dir)
    hint = f"the newest intact checkpoint is {intact}" if intact else f"no intact checkpoint is left under {root}"
    return CheckpointError(f"{err}; {hint}")


def tokenizer_of(ckpt_dir: Path, given: str | None = None):
    """The tokenizer of a checkpoint's run (trainer/checkpoint/tokenizer_copy.py; `given`: --tokenizer
    DIR), read before its weights: a corrupt copy is refused like a corrupt shard."""
    try:
        return checkpoint_tokenizer(ckpt_dir, given)
    except CorruptCheckpoint as err:
        raise _refused(err, Path(ckpt_dir)) from None


def _check_finite(model: torch.nn.Module, source: Path) -> None:
    """Refuse weights holding NaN or inf (a diverged run's): nothing useful comes out of them."""
    bad = nonfinite_tensors(model.state_dict())
    if bad:
        raise CheckpointError(
            f"{source} holds non-finite weights: {describe_nonfinite(bad)}; its run diverged, so use an "
            "earlier checkpoint (--step N for export and sample, ckpt=PATH for eval) or retrain with a lower optim.lr"
        )


def checkpoint_of(run_dir: Path, step: int | None = None) -> Path:
    """A run directory's checkpoint: the newest complete one (`step=None`; `run_dir` may also be a
    checkpoint folder) or the one at `step`."""
    return resolve_checkpoint(run_dir) if step is None else checkpoint_at_step(Path(run_dir), step)


def model_from_run(run_dir: Path, step: int | None = None, device: str | torch.device = "cpu"):
    """(GPT with the checkpoint's weights in eval mode, the run's config) for a run directory.

    `step=None` takes the newest complete checkpoint; `run_dir` may also be a checkpoint folder.
    """
    ckpt = checkpoint_of(Path(run_dir), step)
    cfg = from_dict(read_checkpoint_config(ckpt))
    model = build_model(cfg.model)
    load_model_weights(model, ckpt)
    return model.to(device).eval(), cfg


def checkpoint_at_step(run_dir: Path, step: int) -> Path:
    """The run's complete checkpoint of `step` (--step N), or one line naming the steps it has."""
    ckpt = Path(run_dir) / CHECKPOINT_DIR / step_dir_name(step)
    if not is_complete(ckpt):
        steps = [checkpoint_step(p) for p in list_checkpoints(Path(run_dir) / CHECKPOINT_DIR)]
        raise CheckpointError(f"{run_dir} has no complete checkpoint at step {step}; it has steps {steps or 'none'}")
    return ckpt


def eval_weights_path(run_dir: Path, ckpt: str | None) -> str:
    """ckpt= as given (a state_dict file, a step_* folder, a run dir), else the run's newest checkpoint."""
    if ckpt:
        path = Path(ckpt).expanduser().absolute()
        return str(path if path.is_file() else resolve_checkpoint(path))
    try:
        return str(resolve_checkpoint(run_dir))
    except CheckpointError as err:
        raise CheckpointError(f"{err}; or pass ckpt=PATH (a checkpoint or a state_dict file)") from None


def tokenizer_for_weights(run_dir: Path, weights: str, tokenizer_cfg, given: str | None = None):
    """The tokenizer that reads what `weights` (eval_weights_path's) learned: a checkpoint's own
    (tokenizer_of); for a state_dict file, which records none, the run's newest checkpoint's, else
    `given` (--tokenizer DIR), else the run's `tokenizer` config."""
    if Path(weights).is_dir():
        return tokenizer_of(Path(weights), given)
    newest = latest_checkpoint(run_dir)
    if newest is not None:
        return tokenizer_of(newest, given)
    return load_tokenizer({"name": "hf", "path": given} if given else tokenizer_cfg)


def load_weights(model: torch.nn.Module, weights: str) -> None:
    """Full weights into a plain GPT: a checkpoint directory (any world size / mode) or a state_dict file
    (torch.save of GPT.state_dict(), possibly under "model" and with DDP's or compile's prefixes)."""
    path = Path(weights)
    if not path.is_file():
        load_model_weights(model, path)
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"cannot read {path} as a state_dict ({type(err).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path} does not fit the run's model ({' '.join(str(err).split()[:30])} ...)"
        ) from None
    _check_finite(model, path)


def weights_step(weights: str) -> int | None:
    """The training step of a checkpoint folder; None for a state_dict file."""
    return checkpoint_step(Path(weights)) if Path(weights).is_dir() else None
