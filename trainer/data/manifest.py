"""What a prepared dataset's manifest.json must hold, checked as a whole before anything reads it.

A manifest is written by trainer/prepare/pipeline.py in one piece; one edited by hand, written by another tool or
damaged on disk would otherwise fail deep in a reader (a KeyError on a shard entry, a string where a
token count belongs, ids of another tokenizer trained as GPT-2's). `schema_problem` names the first
thing that is not as prepare writes it; `tokenizer_problem` names a tokenizer other than this
dtrain's. The callers turn either into one line with the `dtrain prepare ... --force` that fixes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from trainer.data.layout import DTYPES, FORMAT
from trainer.tokenizers.gpt2 import GPT2_FINGERPRINT

# A shard's file is a plain name in the dataset folder (prepare's `<split>_NNNNNN.bin`): never a
# path that could point a reader outside it.
SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.bin")
SHA256 = re.compile(r"[0-9a-f]{64}")
SETTINGS_KEYS = ("source", "sha256", "val_fraction", "shard_tokens", "max_tokens", "hf_path", "hf_name", "hf_split")
IDENTITY_KINDS = ("files", "download", "hub")  # what a source_identity records
# key -> (the types it may have, how a message names them)
TOP_LEVEL = {
    "format": ((int,), "a whole number"),
    "dataset": ((str,), "a string"),
    "tokenizer": ((str,), "a string"),
    "dtype": ((str,), "a string"),
    "eot": ((int,), "a whole number"),
    "vocab_size": ((int,), "a whole number"),
    "source": ((str,), "a string"),
    "splits": ((dict,), "an object of splits"),
    "documents": ((int,), "a whole number"),
    "tokens": ((int,), "a whole number"),
    "settings": ((dict,), "an object"),
}


def _kind(value) -> str:
    return {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _is(value, types: tuple) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def schema_problem(manifest) -> str | None:
    """The first way `manifest` (parsed JSON) differs from what prepare writes, as a phrase ("its
    train split's entry 0 has tokens '54744' (a string), not a whole number"); None when it holds
    every key with its type, shard entries of plain file names, counts that add up."""
    if not isinstance(manifest, dict):
        return f"it is {_kind(manifest)}, not an object"
    for key, (types, name) in TOP_LEVEL.items():
        if key not in manifest:
            return f"it has no {key!r}"
        if not _is(manifest[key], types):
            return f"its {key!r} is {manifest[key]!r} ({_kind(manifest[key])}), not {name}"
    for key in ("tokenizer_fingerprint", "tokenizer_path"):  # optional: a dtrain before them wrote neither
        if manifest.get(key) is not None and not isinstance(manifest[key], str):
            return f"its {key!r} is {manifest[key]!r} ({_kind(manifest[key])}), not a string"
    if manifest.get("source_identity") is not None:  # optional too: a dtrain before it did not write it
        problem = identity_problem(manifest["source_identity"])
        if problem:
            return f"its 'source_identity' {problem}"
    missing = [k for k in SETTINGS_KEYS if k not in manifest["settings"]]
    if missing:
        return f"its settings lack {', '.join(missing)}"
    total = 0
    for split, entries in manifest["splits"].items():
        if not isinstance(entries, list):
            return f"its {split!r} split is {_kind(entries)}, not a list of shards"
        for i, entry in enumerate(entries):
            problem = _entry_problem(entry)
            if problem:
                return f"its {split} split's entry {i} {problem}"
            total += entry["tokens"]
    if total != manifest["tokens"]:
        return f"its shards hold {total:,} tokens but its 'tokens' says {manifest['tokens']:,}"
    return None


def identity_problem(identity) -> str | None:
    """How a manifest's `source_identity` (trainer/data/origin.py) differs from what prepare writes:
    {"kind": "files", "files": [{"path", "size", "mtime_ns"}, ...]}, {"kind": "download", "from",
    "sha256"} or {"kind": "hub", ...its coordinates}; None when it is so."""
    if not isinstance(identity, dict):
        return f"is {_kind(identity)}, not an object"
    kind = identity.get("kind")
    if kind not in IDENTITY_KINDS:
        return f"has kind {kind!r}, not one of {', '.join(IDENTITY_KINDS)}"
    if kind != "files":
        return None
    files = identity.get("files")
    if not isinstance(files, list):
        return f"has files {_kind(files)}, not a list"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not all(
                _is(entry.get(key), (int,)) for key in ("size", "mtime_ns")):
            return f"has file entry {i} {entry!r}, not an object of path, size and mtime_ns"
    return None


def _entry_problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return f"is {_kind(entry)}, not an object with file, tokens and sha256"
    for key in ("file", "tokens", "sha256"):
        if key not in entry:
            return f"has no {key!r}"
    file, tokens, digest = entry["file"], entry["tokens"], entry["sha256"]
    if not isinstance(file, str) or not SHARD_NAME.fullmatch(file):
        return f"has file {file!r}, not the name of a .bin file in the dataset folder"
    if not _is(tokens, (int,)) or tokens < 0:
        return f"has tokens {tokens!r} ({_kind(tokens)}), not a whole number of tokens"
    if not isinstance(digest, str) or not SHA256.fullmatch(digest):
        return f"has sha256 {digest!r}, not 64 hex digits"
    return None


def recorded_tokenizer(manifest: dict) -> dict:
    """The tokenizer identity a manifest records (trainer/tokenizers/load.py identity_of). A manifest
    of a dtrain before fingerprints is GPT-2's when it says so: the only tokenizer it could prepare."""
    recorded = {key: manifest.get(key) for key in ("tokenizer", "vocab_size", "eot", "tokenizer_fingerprint")}
    if recorded["tokenizer_fingerprint"] is None and recorded["tokenizer"] == "gpt2":
        recorded["tokenizer_fingerprint"] = GPT2_FINGERPRINT
    return recorded


def tokenizer_problem(manifest: dict, ours: dict) -> str | None:
    """How the tokenizer the manifest records differs from the run's (`ours`, an identity_of), as
    "tokenizer 'hf' with 128,256 ids (end-of-text 128001, fingerprint 3f2a...)"; None when they are
    the same. Only for a manifest without a schema problem."""
    recorded = recorded_tokenizer(manifest)
    if recorded == ours:
        return None
    return describe_tokenizer(recorded)


def describe_tokenizer(identity: dict) -> str:
    text = f"tokenizer {identity['tokenizer']!r} with {identity['vocab_size']:,} ids (end-of-text {identity['eot']}"
    fingerprint = identity.get("tokenizer_fingerprint")
    return text + (f", fingerprint {fingerprint})" if fingerprint else ")")


def format_problem(manifest: dict) -> str | None:
    """A format or dtype this dtrain does not read (an older or newer dtrain's dataset)."""
    dtype = manifest.get("dtype")
    if manifest.get("format") != FORMAT or not isinstance(dtype, str) or dtype not in DTYPES:
        return (f"format {manifest.get('format')!r} / dtype {manifest.get('dtype')!r}, this dtrain reads "
                f"format {FORMAT} / {' or '.join(DTYPES)}")
    return None


def load_manifest(path: Path) -> dict | None:
    """The parsed manifest, or None when it is missing, unreadable or not as prepare writes it
    (shard_reader.read_manifest says which, in one line)."""
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or format_problem(m) or schema_problem(m):
        return None
    return m
