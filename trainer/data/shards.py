"""Open a prepared dataset's shards as read-only uint16 memory maps, after checking them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from trainer.data.layout import DTYPE, FORMAT, MANIFEST, dataset_dir
from trainer.data.prepare import as_data_cfg, prepare_command
from trainer.errors import DataError
from trainer.io import sha256_file
from trainer.writable import nearest_existing

VERIFY_MODES = ("size", "sha256", "auto")
AUTO_SHA256_LIMIT = 1 << 30  # verify="auto" hashes splits smaller than this


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
        raise DataError(f"dataset {cfg.name!r} is not prepared in {root}; run `{prepare_command(cfg)}`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path} is unreadable ({type(e).__name__}); run `{prepare_command(cfg, True)}`"
        ) from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        raise DataError(f"{path} is not a dtrain manifest; run `{prepare_command(cfg, True)}`")
    if manifest.get("format") != FORMAT or manifest.get("dtype") != "uint16":
        raise DataError(
            f"{path} has format {manifest.get('format')!r} / dtype {manifest.get('dtype')!r}, this dtrain "
            f"reads format {FORMAT} / uint16; run `{prepare_command(cfg, True)}`"
        )
    return manifest


def open_split(data_cfg, split: str) -> list[np.memmap]:
    """The shards of ``split`` ("train" or "val") as read-only uint16 memmaps, in order.

    Every shard's size is checked; sha256 too when ``data.verify`` is "sha256", or "auto" and
    the split is under 1 GiB. Any mismatch raises DataError naming the file and the fix.
    """
    cfg = as_data_cfg(data_cfg)
    if cfg.verify not in VERIFY_MODES:
        raise DataError(f"data.verify={cfg.verify!r} is unknown; choose one of {', '.join(VERIFY_MODES)}")
    root = dataset_dir(cfg)
    manifest = _checked_manifest(cfg, root)
    redo = f"run `{prepare_command(cfg, force=True)}`"
    entries = manifest["splits"].get(split)
    if entries is None:
        raise DataError(
            f"dataset {cfg.name!r} in {root} has no {split!r} split (it has "
            f"{', '.join(manifest['splits']) or 'none'}); use train or val, or {redo}"
        )
    if not entries or sum(int(e.get("tokens", 0)) for e in entries) == 0:
        hint = "set data.val_fraction > 0 and " if split == "val" else ""
        raise DataError(f"the {split} split of dataset {cfg.name!r} in {root} is empty; {hint}{redo}")
    total_bytes = sum(int(e["tokens"]) for e in entries) * DTYPE.itemsize
    check_hash = cfg.verify == "sha256" or (cfg.verify == "auto" and total_bytes < AUTO_SHA256_LIMIT)
    maps = []
    for e in entries:
        path = root / e["file"]
        expected = int(e["tokens"]) * DTYPE.itemsize
        if not path.is_file():
            raise DataError(f"shard {path} is missing; {redo}")
        size = path.stat().st_size
        if size != expected:
            raise DataError(
                f"shard {path} has size {size} bytes, the manifest says {expected} "
                f"({e['tokens']} tokens); {redo}"
            )
        if check_hash and e.get("sha256") and sha256_file(path) != e["sha256"]:
            raise DataError(f"shard {path} fails its sha256 check (corrupted or modified); {redo}")
        maps.append(np.memmap(path, dtype=DTYPE, mode="r"))
    return maps

