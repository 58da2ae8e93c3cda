"""Reading a checkpoint without trusting it, and checking it before any tensor is loaded.

DCP's `.metadata` index is a pickle: it is read with an unpickler that admits DCP's own metadata
classes and nothing else, and every DCP load here goes through `SafeReader`, which reads the
index that way. The checks name the checkpoint and what is wrong with it in one line.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from trainer.checkpoint.integrity import CorruptCheckpoint, verify_checkpoint_files
from trainer.checkpoint.layout import MARKER, METADATA_FILE
from trainer.checkpoint.records import check_format, check_model_config, read_checkpoint_config, read_trainer_state
from trainer.errors import CheckpointError
from trainer.io import first_line
from trainer.process.joblog import say

# DCP reports a failure on any rank as CheckpointException, a BaseException.
DCP_ERRORS = (Exception, CheckpointException)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; this admits DCP's own metadata classes and nothing else."""

    ALLOWED_MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )
    ALLOWED = {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a torch.layout from its name
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "getattr"),  # dtypes pickle as getattr(torch, "float32"); checked below
    }

    def find_class(self, module: str, name: str):
        if module in self.ALLOWED_MODULES or (module, name) in self.ALLOWED:
            if (module, name) == ("builtins", "getattr"):
                return _safe_getattr
            if module in self.ALLOWED_MODULES and name.startswith("__"):
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _safe_getattr(obj, name):
    if obj is torch and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"getattr({obj!r}, {name!r}) is not allowed in a checkpoint index")


def read_metadata(path: Path) -> Metadata:
    """DCP's index of a checkpoint, read with the restricted unpickler."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CorruptCheckpoint(path, f"missing {METADATA_FILE}",
                                f"checkpoint {path} has no {METADATA_FILE} (an incomplete save)") from None
    except Exception as err:
        reason = f"corrupt {METADATA_FILE}: {first_line(err)}"
        raise CorruptCheckpoint(path, reason, f"checkpoint {path} has a {reason}") from None
    if not isinstance(metadata, Metadata):
        reason = f"corrupt {METADATA_FILE} (not a DCP index)"
        raise CorruptCheckpoint(path, reason, f"checkpoint {path} has a {reason}")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)  # per-rank metadata: not used by dtrain
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_files(ckpt: Path, metadata: Metadata) -> None:
    """Every shard file the index names exists and is long enough (catches missing or truncated
    shards before any rank starts reading)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = Path(ckpt) / name
        if not file.is_file():
            reason = f"missing shard file {name}"
            raise CorruptCheckpoint(ckpt, reason, f"checkpoint {ckpt} is {reason}; it is corrupt or partial")
        size = file.stat().st_size
        if size < end:
            reason = f"truncated shard file {name}: {size:,} bytes, needs {end:,}"
            raise CorruptCheckpoint(ckpt, reason, f"checkpoint {ckpt} has a {reason}; it is corrupt or partial")


def check_template(ckpt: Path, metadata: Metadata, flat_template: dict[str, torch.Tensor]) -> None:
    """Every tensor the load asks for is a tensor of the same shape in the checkpoint.

    A key stored as bytes would make DCP unpickle it; refusing it here keeps loading pickle-free.
    """
    entries = metadata.state_dict_metadata
    for key, tensor in flat_template.items():
        entry = entries.get(key)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {ckpt} has no entry {key!r}; it was written by another model or version"
            )
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {ckpt} stores {key!r} as a pickled object, not a tensor; refusing it"
            )
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {ckpt} holds {key} of shape {list(entry.size)} but this model's is "
                f"{list(tensor.shape)}; it was written for another model size"
            )


def verify_files(ckpt: Path) -> None:
    """Every file of the checkpoint against the checksums its marker records (CorruptCheckpoint
    names the first that differs); a checkpoint from before checksums loads, with one line saying so."""
    if not verify_checkpoint_files(ckpt):
        say(f"checkpoint {ckpt} has no checksums (written before dtrain recorded them); loading it unverified")


def validate_checkpoint(ckpt: Path, model_cfg=None) -> tuple[Metadata, dict, dict]:
    """Check a checkpoint before loading it; returns (DCP metadata, trainer state, config).

    Raises CorruptCheckpoint for damaged or missing files, CheckpointError for a checkpoint that is
    intact but does not fit (another format or model)."""
    ckpt = Path(ckpt)
    if not (ckpt / MARKER).is_file():
        raise CorruptCheckpoint(ckpt, f"no {MARKER} marker: an interrupted save")
    verify_files(ckpt)
    metadata = read_metadata(ckpt)
    state = read_trainer_state(ckpt)
    cfg = read_checkpoint_config(ckpt)
    check_format(ckpt, state)
    if model_cfg is not None:
        check_model_config(ckpt, cfg, model_cfg)
    check_files(ckpt, metadata)
    return metadata, state, cfg


def nested_failure(err: BaseException) -> BaseException | None:
    """The first per-rank exception inside DCP's CheckpointException, if any."""
    if isinstance(err, CheckpointException):
        for value in err.failures.values():
            exc = value[0] if isinstance(value, tuple) else value
            if isinstance(exc, BaseException):
                return exc
    return None


def root_cause(err: BaseException) -> BaseException:
    """The innermost error inside DCP's wrappers (its CheckpointException names only the ranks)."""
    for _ in range(10):
        inner = nested_failure(err) or err.__cause__
        if inner is None:
            break
        err = inner
    return err
