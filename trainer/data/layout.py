"""Where a dataset lives on disk and the format of its files.

Shared by the sources (their download cache), prepare (which writes a dataset), the shard writer
and shards.py (which reads one), so none of them has to import another just for these.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainer.config.validation import check_dataset_name
from trainer.config.vocab import tokenizer_tag

MANIFEST = "manifest.json"  # written last; its presence is what makes a dataset valid
FORMAT = 1
DTYPE = np.dtype("<u2")  # GPT-2 token ids (< 65536), raw little-endian: the default and older datasets'
# The dtypes a manifest may name: uint32 holds a vocabulary of more than 65,536 ids (tokenizers.shard_dtype).
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dataset_dir(data_cfg) -> Path:
    """``<data.dir>/<data.name>`` with ``~`` expanded, for a typed data config (prepare.as_data_cfg).
    A name that is not one folder name (empty, '..', a path) is refused here too, so that no caller
    reads or writes a dataset outside data.dir (the config's checks refuse it first)."""
    check_dataset_name(data_cfg)
    # A dataset prepared with another tokenizer than GPT-2's lives beside GPT-2's, tagged with the
    # tokenizer file's digest: `tokenizer=hf tokenizer.path=DIR` finds its own, and GPT-2's stays.
    tag = tokenizer_tag(data_cfg.get("tokenizer"))
    return Path(os.path.expanduser(str(data_cfg.dir))) / (f"{data_cfg.name}.tok-{tag}" if tag else data_cfg.name)


def raw_dir(data_cfg) -> Path:
    """Cached downloads (source archives), kept across re-prepares."""
    return dataset_dir(data_cfg) / "raw"
