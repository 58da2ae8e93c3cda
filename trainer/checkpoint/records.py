"""A checkpoint's JSON records (trainer state, config), read and checked without torch.

What a resume trusts and what the run-directory checks compare must be the same checkpoint: resume=auto
loads the newest checkpoint that verifies and sets newer corrupt ones aside (selection.py), so the
checks before anything is written (continuation.py) pick it here the same way: its marker, every
file against the marker's checksums, its index present, both JSON records readable and of this
format. Only the DCP index's contents need torch to read; its checksum covers it. Standard library
plus xxhash, like integrity.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint.integrity import CorruptCheckpoint, verify_checkpoint_files
from trainer.checkpoint.layout import CONFIG_FILE, FORMAT_VERSION, MARKER, METADATA_FILE, STATE_FILE, marked_checkpoints
from trainer.config.schema import ModelConfig
from trainer.errors import CheckpointError
from trainer.io import first_line

# Model fields that must agree between a checkpoint and the run that loads it, with the value a
# checkpoint written before the field existed was trained with (GPT-2's block).
MODEL_FIELDS = {k: getattr(ModelConfig, k) for k in (
    "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "pad_vocab_multiple", "bias", "norm", "norm_eps",
    "pos", "rope_theta", "mlp", "mlp_hidden", "mlp_multiple_of", "n_kv_head", "head_dim", "qk_norm",
    "tie_embeddings")}


def read_json(path: Path, what: str) -> dict:
    """A checkpoint's JSON object; CorruptCheckpoint when it is missing, unreadable or not an object."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        message = f"checkpoint {path.parent} has no {path.name} ({what}); it is incomplete"
        raise CorruptCheckpoint(path.parent, f"missing {path.name}", message) from None
    except (OSError, ValueError) as err:
        reason = f"corrupt {path.name}: {first_line(err)}"
        raise CorruptCheckpoint(path.parent, reason, f"checkpoint {path.parent} has a {reason}") from None
    if not isinstance(record, dict):
        reason = f"corrupt {path.name}: not a JSON object"
        raise CorruptCheckpoint(path.parent, reason, f"checkpoint {path.parent} has a {reason}")
    return record


def read_checkpoint_config(ckpt: Path) -> dict:
    """The resolved config recorded by the run that wrote the checkpoint."""
    return read_json(Path(ckpt) / CONFIG_FILE, "the run's config")


def read_trainer_state(ckpt: Path) -> dict:
    return read_json(Path(ckpt) / STATE_FILE, "step, data position and RNG states")


def check_format(ckpt: Path, state: dict) -> None:
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format {state.get('format')!r}; this dtrain reads {FORMAT_VERSION}"
        )


@dataclass
class Resumable:
    """The checkpoint resume=auto will load, its records, and the newer corrupt ones it passes over."""

    ckpt: Path
    state: dict
    config: dict
    passed_over: list[CorruptCheckpoint] = field(default_factory=list)


def intact_records(ckpt: Path) -> tuple[dict, dict]:
    """(trainer state, config) of a checkpoint whose files verify; CorruptCheckpoint otherwise,
    CheckpointError for an intact one this dtrain cannot read (another format or checksum)."""
    ckpt = Path(ckpt)
    if not (ckpt / MARKER).is_file():
        raise CorruptCheckpoint(ckpt, f"no {MARKER} marker: an interrupted save")
    verify_checkpoint_files(ckpt)  # False (nothing to verify) for a checkpoint from before checksums
    if not (ckpt / METADATA_FILE).is_file():
        raise CorruptCheckpoint(ckpt, f"missing {METADATA_FILE}",
                                f"checkpoint {ckpt} has no {METADATA_FILE} (an incomplete save)")
    state = read_trainer_state(ckpt)
    config = read_checkpoint_config(ckpt)
    check_format(ckpt, state)
    return state, config


def newest_resumable(root: Path) -> Resumable | None:
    """What resume=auto will load from a `checkpoints/` folder (selection.choose_own, without
    moving anything): None when it holds no checkpoint, CheckpointError when none is intact."""
    corrupt: list[CorruptCheckpoint] = []
    for ckpt in marked_checkpoints(root):
        try:
            state, config = intact_records(ckpt)
        except CorruptCheckpoint as err:
            corrupt.append(err)
            continue
        return Resumable(ckpt, state, config, corrupt)
    if corrupt:
        raise CheckpointError(none_intact(corrupt[0], root))
    return None


def none_intact(first: CorruptCheckpoint, root: Path) -> str:
    return (f"{first}, and no intact checkpoint is left under {root} to fall back to; "
            "start afresh in another hydra.run.dir= or resume=PATH from a good checkpoint")


def check_model_config(ckpt: Path, saved_cfg: dict, model_cfg) -> None:
    saved = saved_cfg.get("model", {})
    diffs = [
        f"{k}={saved.get(k, old)!r} vs {model_cfg[k]!r}" for k, old in MODEL_FIELDS.items()
        if saved.get(k, old) != model_cfg[k]
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} was written for another model (model={saved.get('name')!r}: "
            f"{', '.join(diffs)} in this run); resume with the same model settings or use a new run dir"
        )
