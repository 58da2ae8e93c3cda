"""Open a prepared dataset's shards as read-only memory maps (uint16 or uint32), after checking them:
the manifest as a whole, the run's tokenizer against the one it records, each shard's size (and ids)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from trainer.data.hints import prepare_hint
from trainer.data.layout import DTYPES, MANIFEST, as_data_cfg, dataset_dir
from trainer.data.manifest import describe_tokenizer, format_problem, schema_problem, tokenizer_problem
from trainer.errors import DataError
from trainer.io import nearest_existing
from trainer.tokenizers.load import load_tokenizer

VERIFY_MODES = ("size", "sha256", "auto")
AUTO_SHA256_LIMIT = 1 << 30  # verify="auto" hashes splits smaller than this
READ_BYTES = 1 << 22  # a multiple of 4: a block holds whole ids of either dtype (a shard's size is checked first)


def read_manifest(data_cfg) -> dict:
    """The dataset's manifest; DataError (with the prepare command) when missing or unreadable."""
    cfg = as_data_cfg(data_cfg)
    return _checked_manifest(cfg, dataset_dir(cfg))


def _checked_manifest(cfg: DictConfig, root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        in_the_way = nearest_existing(root)
        if not in_the_way.is_dir():  # preparing into it would fail the same way
            raise DataError(f"data.dir={cfg.dir}: {in_the_way} is a file, not a folder; set data.dir to the "
                            "folder that holds your prepared datasets")
        raise DataError(f"dataset {cfg.name!r} is not prepared in {root}; {prepare_hint(cfg)}")
    redo = redo_command(cfg)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({type(e).__name__}); {redo}") from e
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is not a dtrain manifest; {redo}")
    problem = format_problem(manifest)
    if problem:
        raise DataError(f"{path} has {problem}; {redo}")
    problem = schema_problem(manifest)
    if problem:
        raise DataError(f"{path} is not a manifest as dtrain prepare writes it: {problem}; {redo}")
    refuse_foreign_tokenizer(cfg, path, manifest)
    return manifest


def run_tokenizer(cfg: DictConfig) -> dict:
    """The identity of the tokenizer the config names (cfg.tokenizer: the run's `tokenizer` group)."""
    return load_tokenizer(cfg.tokenizer).identity


def refuse_foreign_tokenizer(cfg: DictConfig, path: Path, manifest: dict) -> None:
    """DataError when the manifest records another tokenizer than the run's: its ids would be read
    as another vocabulary's."""
    ours = run_tokenizer(cfg)
    problem = tokenizer_problem(manifest, ours)
    if problem:
        raise DataError(f"{path} records {problem}, but this run's tokenizer is {describe_tokenizer(ours)}; "
                        "set tokenizer=... to the one the data was prepared with, or prepare it again with "
                        f"this one: {prepare_hint(cfg, force=True)}")


def open_split(data_cfg, split: str) -> list[np.memmap]:
    """The shards of ``split`` ("train" or "val") as read-only memmaps of the manifest's dtype, in order.

    Every shard's size is checked; its sha256 and its ids (all within the tokenizer's vocabulary) too when
    ``data.verify`` is "sha256", or "auto" and the split is under 1 GiB (otherwise the loader checks
    the ids of each batch it reads). Any mismatch raises DataError naming the file and the fix.
    """
    cfg = as_data_cfg(data_cfg)
    if cfg.verify not in VERIFY_MODES:
        raise DataError(f"data.verify={cfg.verify!r} is unknown; choose one of {', '.join(VERIFY_MODES)}")
    root = dataset_dir(cfg)
    manifest = _checked_manifest(cfg, root)
    redo = redo_command(cfg)
    entries = manifest["splits"].get(split)
    if entries is None:
        raise DataError(
            f"dataset {cfg.name!r} in {root} has no {split!r} split (it has "
            f"{', '.join(manifest['splits']) or 'none'}); use train or val, or {redo}"
        )
    if not entries or sum(e["tokens"] for e in entries) == 0:
        hint = "set data.val_fraction > 0 and " if split == "val" else ""
        raise DataError(f"the {split} split of dataset {cfg.name!r} in {root} is empty; {hint}{redo}")
    dtype, vocab = DTYPES[manifest["dtype"]], manifest["vocab_size"]
    total_bytes = sum(e["tokens"] for e in entries) * dtype.itemsize
    check_hash = cfg.verify == "sha256" or (cfg.verify == "auto" and total_bytes < AUTO_SHA256_LIMIT)
    maps = []
    for e in entries:
        path = root / e["file"]
        expected = e["tokens"] * dtype.itemsize
        if not path.is_file():
            raise DataError(f"shard {path} is missing; {redo}")
        size = path.stat().st_size
        if size != expected:
            raise DataError(
                f"shard {path} has size {size} bytes, the manifest says {expected} "
                f"({e['tokens']} tokens); {redo}"
            )
        if check_hash:
            digest, largest = _digest_and_largest_id(path, dtype)
            if digest != e["sha256"]:
                raise DataError(f"shard {path} fails its sha256 check (corrupted or modified); {redo}")
            if largest >= vocab:
                raise DataError(out_of_vocabulary(path, largest, vocab, redo))
        maps.append(np.memmap(path, dtype=dtype, mode="r"))
    return maps


def redo_command(data_cfg) -> str:
    """The fix for a damaged dataset, as messages end: run `dtrain prepare ... --force` (hints.prepare_hint)."""
    return prepare_hint(data_cfg, force=True)


def out_of_vocabulary(path, token_id: int, vocab_size: int, redo: str) -> str:
    """The message for a shard holding an id the tokenizer (and so the model) does not have."""
    return (f"shard {path} holds token id {token_id:,}, beyond the tokenizer's {vocab_size:,} ids (the "
            f"dataset was not prepared by this dtrain or is damaged); {redo}")


def _digest_and_largest_id(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """The shard's sha256 and its largest token id, in one read of the file."""
    digest, largest = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
            largest = max(largest, int(np.frombuffer(block, dtype=dtype).max()))
    return digest.hexdigest(), largest
