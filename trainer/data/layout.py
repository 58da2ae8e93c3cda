"""Where a dataset lives on disk and the format of its files.

Shared by the sources (their download cache), the pipeline (which writes a dataset), the shard writer
(trainer/prepare/) and shard_reader.py (which reads one), so none of them has to import another just for these.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import DataConfig, TokenizerConfig
from trainer.config.validation import check_dataset_name
from trainer.config.vocab import tokenizer_tag

MANIFEST = "manifest.json"  # written last; its presence is what makes a dataset valid
FORMAT = 1
DTYPE = np.dtype("<u2")  # GPT-2 token ids (< 65536), raw little-endian: the default and older datasets'
# The dtypes a manifest may name: uint32 holds a vocabulary of more than 65,536 ids (tokenizers.shard_dtype).
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def as_data_cfg(data_cfg) -> DictConfig:
    """Accept a DictConfig (cfg.data), a DataConfig dataclass or a plain dict of DataConfig keys.

    The public entry points (prepare, is_prepared, shard_reader.read_manifest / open_split) call this
    once; the helpers below them take the config it returns."""
    if isinstance(data_cfg, DictConfig):
        return data_cfg
    if dataclasses.is_dataclass(data_cfg):
        values = dataclasses.asdict(data_cfg)
    elif isinstance(data_cfg, dict):
        values = {**dataclasses.asdict(DataConfig()), **data_cfg}
    else:
        raise TypeError(f"expected a data config, got {type(data_cfg).__name__}")
    if str(values.get("dir", "")).startswith("${oc.env:DTRAIN_DATA_DIR"):  # outside Hydra: resolve here
        values["dir"] = str(default_data_dir())
    if not isinstance(values.get("tokenizer"), dict):  # the root's `tokenizer` is not there: the schema's
        values["tokenizer"] = dataclasses.asdict(TokenizerConfig())
    return OmegaConf.create(values)


def default_data_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("DTRAIN_DATA_DIR") or "~/.cache/dtrain/data"))


def val_token_count(total: int, val_fraction: float) -> int:
    """The tokens of a `total`-token stream that go to validation, as prepare cuts them (the tokenizer fit and
    the data.max_tokens check predict the same split): a rounded
    fraction, at least one when there is a split, never the whole stream."""
    n_val = int(round(total * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    return max(0, min(n_val, total - 1))


def dataset_dir(data_cfg) -> Path:
    """``<data.dir>/<data.name>`` with ``~`` expanded, for a typed data config (as_data_cfg).
    A name that is not one folder name (empty, '..', a path) is refused here too, so that no caller
    reads or writes a dataset outside data.dir (the config's checks refuse it first)."""
    check_dataset_name(data_cfg)
    # A dataset prepared with another tokenizer than GPT-2's lives beside GPT-2's, tagged with the
    # tokenizer file's digest: `tokenizer=hf tokenizer.path=DIR` finds its own, and GPT-2's stays.
    tag = tokenizer_tag(data_cfg.get("tokenizer"))
    return Path(os.path.expanduser(str(data_cfg.dir))) / (f"{data_cfg.name}.tok-{tag}" if tag else data_cfg.name)


def prepared_folders(data_cfg) -> list[Path]:
    """Where a dataset of data.name may have been prepared, the run's tokenizer's folder first, then
    GPT-2's (`<name>`) and every other tokenizer's (`<name>.tok-<digest>`)."""
    own = dataset_dir(data_cfg)
    base = own.parent
    others = [base / data_cfg.name, *sorted(base.glob(f"{glob.escape(str(data_cfg.name))}.tok-*"))]
    return [own, *(folder for folder in others if folder != own)]


def raw_dir(data_cfg) -> Path:
    """Cached downloads (source archives), kept across re-prepares."""
    return dataset_dir(data_cfg) / "raw"
