"""The `dtrain prepare ...` line a message prints to (re)build a dataset, runnable as printed.

Its source is the config's, or, when the config names none (data.name alone), the one that data.name
was prepared from with any tokenizer (trainer/data/origin.py): data.name alone then prepares from
that record, so the hint does not repeat a data.source the user did not type. Where nothing says
what the text is (a data.name never prepared, without data.source), the hint says that data.source
is needed instead of printing a command that would fail.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.config.dataset_names import (
    CORPUS_NAMES,
    DATASETS,
    DEFAULT_TEXT_FIELD,
    TEXT_SOURCE_NEEDED,
    TEXT_UNNAMED,
    hf_dataset_name,
    text_dataset_name,
)
from trainer.data.layout import as_data_cfg, default_data_dir
from trainer.data.origin import with_recorded_source

# data=hf's keys (conf/data/hf.yaml) that a prepare command repeats only when they differ from these
HF_DEFAULTS = {"hf_name": None, "hf_split": "train", "text_field": DEFAULT_TEXT_FIELD}


def prepare_command(cfg: DictConfig, force: bool = False) -> str:
    """The ``dtrain prepare ...`` line that (re)builds this dataset, for messages: its source is the
    config's, or when the config names none the one its data.name was prepared from (with any
    tokenizer). Runs as printed where prepare_hint says `run`. A data.source that only the record
    gives is not repeated: data.name alone prepares from it (origin.with_recorded_source)."""
    typed_source = cfg.get("source")
    cfg = with_recorded_source(cfg)
    parts = ["dtrain", "prepare"]
    if cfg.name in DATASETS and cfg.name != TEXT_UNNAMED:
        parts.append(f"data={cfg.name}")
    elif cfg.hf_path:  # data=hf: its coordinates, and its name unless they derive it
        parts += ["data=hf", f"data.hf_path={cfg.hf_path}"]
        parts += [f"data.{key}={cfg[key]}" for key, default in HF_DEFAULTS.items() if cfg[key] != default]
        if cfg.name != hf_dataset_name(cfg.hf_path, cfg.hf_name, cfg.hf_split, cfg.text_field):
            parts.append(f"data.name={cfg.name}")
    else:  # data=text: its name unless its source derives it
        parts.append("data=text")
        if not typed_source or cfg.name != text_dataset_name(cfg.source):
            parts.append(f"data.name={cfg.name}")
    if typed_source:
        parts.append(f"data.source={cfg.source}")
    data_dir = Path(os.path.expanduser(str(cfg.dir)))
    if data_dir.resolve() != default_data_dir().resolve():
        parts.append(f"data.dir={cfg.dir}")
    tok = cfg.get("tokenizer")
    if tok is not None and tok.name != "gpt2":
        parts += [f"tokenizer={tok.name}", f"tokenizer.path={tok.path}"]
    if force:
        parts.append("--force")
    return shlex.join(parts)


def prepare_hint(data_cfg, force: bool = False) -> str:
    """How a message says to (re)build this dataset: "run `dtrain prepare ...`" when that line runs as
    printed (the config or a record of data.name names its source, or the dataset is a preset's);
    else what is missing, data.source."""
    cfg = with_recorded_source(as_data_cfg(data_cfg))
    if cfg.source or cfg.hf_path or cfg.name in CORPUS_NAMES:
        return f"run `{prepare_command(cfg, force)}`"
    if cfg.name == TEXT_UNNAMED:
        return TEXT_SOURCE_NEEDED
    flag = " --force" if force else ""
    return (f"nothing records the text of {cfg.name!r}: prepare it from your text with dtrain prepare data=text "
            f"data.name={cfg.name} data.source=FILES{flag} (FILES: a file, a folder of .txt files or a glob; or "
            "data=hf with its data.hf_path)")


def use_tokenizer_command(data_cfg, tokenizer_path) -> str:
    """The `dtrain prepare` line that prepares data_cfg's dataset with the tokenizer `dtrain tokenizer
    train` wrote to tokenizer_path."""
    values = OmegaConf.to_container(as_data_cfg(data_cfg), resolve=True)
    return prepare_command(OmegaConf.create({**values, "tokenizer": {"name": "hf", "path": str(tokenizer_path)}}))


