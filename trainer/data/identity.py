"""What data a run trains on, as its checkpoints record it: per split, the token count, the number
of shards and one digest over the manifest's shard checksums and sizes; and the tokenizer the
manifest says made its ids. The same text prepared with the same settings again has the same
identity; other text does not. A mixture's (data.mix) is each source's, its splits named
`<source>/<split>`, and their one tokenizer. Torch-free (the run-directory checks compare it before
torch is imported)."""

from __future__ import annotations

import hashlib

from trainer.data.layout import MANIFEST, as_data_cfg, dataset_dir
from trainer.data.manifest import load_manifest, recorded_tokenizer
from trainer.data.mixture import source_configs

# The manifest's fields that say how its ids were made.
TOKENIZER_FIELDS = ("tokenizer", "vocab_size", "eot", "tokenizer_fingerprint")


def data_identity(data_cfg) -> dict | None:
    """{split: {"tokens", "shards", "sha256"}} of the prepared dataset, or None when it has no manifest."""
    if sources := source_configs(data_cfg):
        parts = {name: data_identity(source) for name, source in sources.items()}
        if any(part is None for part in parts.values()):
            return None
        return {f"{name}/{split}": split_id for name, part in parts.items() for split, split_id in part.items()}
    manifest = load_manifest(dataset_dir(as_data_cfg(data_cfg)) / MANIFEST)
    if manifest is None:
        return None
    return {split: _split_identity(entries) for split, entries in sorted(manifest["splits"].items())}


def recorded_identity(data_cfg) -> dict:
    """What a checkpoint records of its data: {"data": data_identity, "tokenizer": tokenizer_identity}."""
    return {"data": data_identity(data_cfg), "tokenizer": tokenizer_identity(data_cfg)}


def tokenizer_identity(data_cfg) -> dict | None:
    """{"tokenizer", "vocab_size", "eot", "tokenizer_fingerprint"} as the prepared dataset's manifest
    records them (manifest.recorded_tokenizer), or None when it has no manifest. A mixture's sources
    share one (mixture.check_sources): the first one's."""
    if sources := source_configs(data_cfg):
        return tokenizer_identity(next(iter(sources.values())))
    manifest = load_manifest(dataset_dir(as_data_cfg(data_cfg)) / MANIFEST)
    if manifest is None:
        return None
    return recorded_tokenizer(manifest)


def tokenizer_changes(was: dict, now: dict) -> list[str]:
    """One phrase per tokenizer field that differs, e.g. "tokenizer 'gpt2' then, 'hf' now". A field
    the older record lacks (a checkpoint from before fingerprints) is not a change."""
    return [f"{key} {was.get(key)!r} then, {now.get(key)!r} now" for key in TOKENIZER_FIELDS
            if key in was and was.get(key) != now.get(key)]


def data_changes(was: dict, now: dict) -> list[str]:
    """What differs between the data and tokenizer a checkpoint recorded (its trainer state's "data"
    and "tokenizer") and `now` (recorded_identity of the data a run reads now), in identity_changes'
    and tokenizer_changes' phrases. A part either lacks (a checkpoint from before it was recorded,
    data without a manifest) is not a change."""
    changes = []
    if isinstance(was.get("data"), dict) and now.get("data") is not None:
        changes += identity_changes(was["data"], now["data"])
    if isinstance(was.get("tokenizer"), dict) and now.get("tokenizer") is not None:
        changes += tokenizer_changes(was["tokenizer"], now["tokenizer"])
    return changes


def _split_identity(entries: list[dict]) -> dict:
    digest = hashlib.sha256()
    for entry in entries:
        digest.update(f"{int(entry['tokens'])}:{entry.get('sha256', '')}\n".encode())
    return {"tokens": sum(int(e["tokens"]) for e in entries), "shards": len(entries),
            "sha256": digest.hexdigest()}


def identity_changes(was: dict, now: dict) -> list[str]:
    """One phrase per split whose identity differs, e.g. "train split: 301,204 tokens in 1 shard
    then, 250,116 in 1 now"; empty when the data is the same."""
    changes = []
    for split in sorted(set(was) | set(now)):
        old, new = was.get(split), now.get(split)
        if old == new:
            continue
        if old is None or new is None:
            changes.append(f"{split} split {'added' if old is None else 'gone'}")
        elif (old.get("tokens"), old.get("shards")) == (new.get("tokens"), new.get("shards")):
            changes.append(f"{split} split: as many tokens ({new['tokens']:,}), other ones (checksums differ)")
        else:
            changes.append(f"{split} split: {old.get('tokens', 0):,} tokens in {_shards(old.get('shards'))} then, "
                           f"{new['tokens']:,} in {_shards(new['shards'])} now")
    return changes


def _shards(n) -> str:
    return f"{n} shard{'' if n == 1 else 's'}"
