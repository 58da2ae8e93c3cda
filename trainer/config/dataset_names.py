"""What a `data=hf` dataset reads (a Hugging Face Hub id, or local files) and the folder name a
`data=hf` or `data=text` dataset is prepared into, derived from what it reads so that two datasets
never share a folder.

`data.name` of conf/data/hf.yaml is the resolver below: `<repo or folder>[-<hf_name>]-<split>
[-<text_field>]-<8 hex digits>`, the digits a sha256 of all four coordinates (a local path taken
absolute), e.g. `TinyStories-train-1c0ffee5`. conf/data/text.yaml's is `<file or folder>-<8 hex
digits>`, the digits a sha256 of data.source taken absolute, e.g. `notes-3f2a9c01` for
`data.source='notes/*.txt'`. Setting data.name names the folder yourself; the same data.name then
finds it when you train. Standard library only: composing a config runs this before torch and
before `datasets` are imported.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re

UNNAMED = "hf"  # data.name of `data=hf` while data.hf_path is unset: a reserved name, validation refuses it
# data.name of `data=text` while data.source is unset: what such a run reads unless a dataset of that
# name was prepared (by a dtrain before derived names) or data.name names one
TEXT_UNNAMED = "text"
# The corpora read by name, each in a format of its own (trainer/prepare/sources.py reads them; a
# message's `dtrain prepare` line, trainer/data/hints.py, knows them without importing the preparation).
CORPUS_NAMES = ("shakespeare", "tinyshakespeare")
# The conf/data presets, as `dtrain prepare data=NAME` names them (data=hf derives its name).
DATASETS = ("shakespeare", "tinyshakespeare", TEXT_UNNAMED, "fineweb_edu")
DEFAULT_TEXT_FIELD = "text"  # the field every dataset read before data.text_field existed
HF_NAME_RESOLVER = "dtrain_hf_dataset_name"
TEXT_NAME_RESOLVER = "dtrain_text_dataset_name"
HF_PATH_NEEDED = ("data=hf needs data.hf_path: a Hugging Face dataset id (e.g. data.hf_path=roneneldan/TinyStories) "
                  "or local .parquet/.jsonl/.json/.txt files (a folder, a file or a glob); or data.name=NAME of a "
                  "dataset prepared before")
TEXT_SOURCE_NEEDED = ("data=text needs data.source to prepare your text (a file, a folder of .txt files or a glob, "
                      "e.g. data.source='notes/*.txt'), or data.name=NAME of a dataset prepared before")
# Local files dtrain reads itself: records (a text field each) or plain text (one document per file).
RECORD_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".json", ".json.gz")
LOCAL_SUFFIXES = (*RECORD_SUFFIXES, ".txt")
_PART = 40  # the most characters one readable part of a derived name keeps


def is_local(hf_path: str) -> bool:
    """A local folder, file or glob rather than a Hub id (`owner/name`, or `name`)."""
    path = os.path.expanduser(str(hf_path))
    return (os.path.exists(path) or glob.has_magic(path) or path in (".", "..")
            or path.startswith(("/", "./", "../", "~")) or path.lower().endswith(LOCAL_SUFFIXES))


def where(hf_path: str) -> str:
    """hf_path as recorded: a local path absolute (the same folder from any working directory), a Hub id as given."""
    return os.path.abspath(os.path.expanduser(str(hf_path))) if is_local(hf_path) else str(hf_path)


def is_url(source: str) -> bool:
    return str(source).startswith(("http://", "https://", "ftp://"))


def resolve_local(source: str) -> str:
    """data.source as recorded: a local path or glob absolute and user-expanded, a URL as given."""
    return str(source) if is_url(source) else os.path.abspath(os.path.expanduser(str(source)))


def _stem(hf_path: str) -> str:
    """The readable head of a derived name: a Hub repo's name, a local folder's or file's name (of
    a glob, the folder above its first wildcard)."""
    if not is_local(hf_path):
        return str(hf_path).rstrip("/").rsplit("/", 1)[-1]
    return _path_stem(where(hf_path))


def _path_stem(path: str) -> str:
    """A local file's or folder's name, without a text or record suffix; of a glob, the folder above
    its first wildcard."""
    parts = path.split(os.sep)
    if glob.has_magic(path):
        parts = parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]
    stem = next((p for p in reversed(parts) if p), "root")
    for suffix in sorted(LOCAL_SUFFIXES, key=len, reverse=True):
        if stem.lower().endswith(suffix) and len(stem) > len(suffix):
            return stem[: -len(suffix)]
    return stem


def _slug(text: str) -> str:
    """One folder-name-safe part: no separators, no leading dot (a hidden folder)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._-")[:_PART].strip("._-")


def hf_dataset_name(hf_path: str | None, hf_name: str | None, split: str | None,
                    text_field: str | None) -> str:
    """data.name of `data=hf`: readable, and distinct for every (hf_path, hf_name, split, text_field)."""
    if not hf_path:
        return UNNAMED
    coordinates = [where(hf_path), hf_name, split, text_field]
    digest = hashlib.sha256(json.dumps(coordinates).encode()).hexdigest()[:8]
    field = text_field if text_field != DEFAULT_TEXT_FIELD else None
    parts = [_slug(str(p)) for p in (_stem(hf_path), hf_name, split, field) if p]
    return "-".join([p for p in parts if p] + [digest])



def text_dataset_name(source: str | None) -> str:
    """data.name of `data=text`: readable, and distinct for every data.source (taken absolute, so the
    same files typed from another folder find the same dataset); TEXT_UNNAMED without one."""
    if not source:
        return TEXT_UNNAMED
    recorded = resolve_local(source)
    digest = hashlib.sha256(recorded.encode()).hexdigest()[:8]
    stem = _slug(_path_stem(recorded))
    return f"{stem}-{digest}" if stem else digest
