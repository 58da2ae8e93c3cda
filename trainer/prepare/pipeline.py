"""Tokenize a dataset into token shards (uint16, or uint32 for a vocabulary over 65,536) plus a manifest.

Layout of ``<data.dir>/<data.name>/``::

    manifest.json          written last; its presence is what makes the dataset valid
    train_000000.bin ...   raw little-endian token ids (the manifest's dtype), at most data.shard_tokens each
    val_000000.bin ...
    raw/                   cached downloads (source archives), kept across re-prepares

The token stream is ``EOT doc0 EOT doc1 ...`` (the tokenizer's end-of-text id, GPT-2's 50256, separates
documents; the `tokenizer` group picks the tokenizer, trainer/tokenizers/load.py). The validation
split is the last ``val_fraction`` of the stream (cut at a token), train is the rest, so a
dataset of a single document still gets both splits.

Tokenizing runs in a process pool over ~0.5 MB pieces of text (tokenize_pool.py); the stream
is written and cut into shards by shard_writer.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from trainer.config.dataset_names import DEFAULT_TEXT_FIELD, resolve_local, where
from trainer.data.hints import prepare_command
from trainer.data.in_use import rewriting
from trainer.data.layout import DTYPES, FORMAT, MANIFEST, as_data_cfg, dataset_dir, val_token_count
from trainer.data.manifest import SETTINGS_KEYS, load_manifest, tokenizer_problem
from trainer.data.origin import (
    describe_source,
    file_changes,
    file_stats,
    names_source,
    recorded,
    source_conflict,
    source_settings,
    with_recorded_source,
)
from trainer.data.shard_reader import refuse_foreign_tokenizer, run_tokenizer
from trainer.errors import DataError
from trainer.io import check_writable_dir, first_missing, sha256_file, write_errors_as_user_errors
from trainer.prepare import sources
from trainer.prepare.shard_writer import StreamWriter, split_stream
from trainer.prepare.tokenize_pool import PIECE_CHARS, encoding_pool, piece_batches
from trainer.tokenizers.load import load_tokenizer, shard_dtype

# ------------------------------------------------------------------------------------- config

# The fewest tokens a dataset can hold: the end-of-text marker that opens the first document and
# one token of its text (split into train and val when data.val_fraction > 0).
MIN_TOKENS = 2


def settings_of(cfg: DictConfig) -> dict:
    """The config values a prepared dataset depends on (recorded in the manifest). The text field is
    there when it is not "text", the field every dataset read before data.text_field: a dataset
    prepared then has the settings it would have now."""
    out = {k: cfg[k] for k in SETTINGS_KEYS}
    if out["source"]:
        out["source"] = resolve_local(out["source"])
    if out["hf_path"]:
        out["hf_path"] = where(out["hf_path"])  # local files absolute; a Hub id as given
    if cfg.get("text_field", DEFAULT_TEXT_FIELD) != DEFAULT_TEXT_FIELD:
        out["text_field"] = cfg.text_field
    return out


def _files_intact(root: Path, manifest: dict) -> bool:
    for entries in manifest["splits"].values():
        for e in entries:
            p = root / e["file"]
            if not p.is_file() or p.stat().st_size != e["tokens"] * DTYPES[manifest['dtype']].itemsize:
                return False
    return True


def is_prepared(data_cfg, files: bool = True) -> bool:
    """A manifest with the current settings exists, every shard has its recorded size and, when the
    config names its source (and `files`), that source's files are as they were read."""
    cfg = as_data_cfg(data_cfg)
    return _up_to_date(with_recorded_source(cfg), files and names_source(cfg))


def _up_to_date(cfg: DictConfig, source_named: bool) -> bool:
    root = dataset_dir(cfg)
    m = load_manifest(root / MANIFEST)
    if m is None or m["settings"] != settings_of(cfg) or tokenizer_problem(m, run_tokenizer(cfg)):
        return False
    if source_named and _source_changes(cfg, m.get("source_identity")):
        return False
    return _files_intact(root, m)


def _source_changes(cfg: DictConfig, identity: dict | None) -> list[str]:
    """How the local files the config reads differ from those a manifest's source_identity records."""
    if identity is None or identity.get("kind") != "files":
        return []
    now = sources.local_files(cfg)
    return [] if now is None else file_changes(identity["files"], file_stats(now))


def source_changes(data_cfg) -> list[str]:
    """The config names its source and data.name's dataset (the run's tokenizer's folder) was
    prepared from it: one phrase per file added, removed or changed on disk since (origin.file_changes)."""
    cfg = as_data_cfg(data_cfg)
    record = recorded(cfg) if names_source(cfg) else None
    if record is None or record.folder != dataset_dir(cfg) or source_conflict(cfg, record):
        return []
    return _source_changes(cfg, record.identity)


def _source_key(cfg: DictConfig) -> str:
    return "data.source" if cfg.source else "data.hf_path"


def refuse_other_source(data_cfg) -> None:
    """DataError when the config names another source than the one data.name was prepared from."""
    cfg = as_data_cfg(data_cfg)
    conflict = source_conflict(cfg, recorded(cfg))
    if conflict:
        key = _source_key(cfg)
        raise DataError(f"{conflict}; prepare {key}={cfg.source or cfg.hf_path} under a data.name of its own, drop "
                        f"{key} to use the prepared {cfg.name!r}, or prepare {cfg.name!r} anew from it: run "
                        f"`{prepare_command(cfg, force=True)}`")


def check_prepared_source(data_cfg, files: bool = True) -> None:
    """What training refuses of a config that names its source: another source than data.name was
    prepared from, or (with `files`) the same one changed on disk since. A config of data.name alone
    passes (its files are not looked at: the raw text may be gone)."""
    cfg = as_data_cfg(data_cfg)
    _keep_foreign(cfg)  # another tokenizer's ids in the folder: said first, as prepare and the reader say it
    refuse_other_source(cfg)
    changes = source_changes(cfg) if files else []
    if changes:
        raise DataError(f"{describe_source(source_settings(cfg))} changed on disk since dataset {cfg.name!r} was "
                        f"prepared from it ({'; '.join(changes)}); prepare it again: run "
                        f"`{prepare_command(cfg, force=True)}`, or drop {_source_key(cfg)} to train on the data as "
                        "prepared")


def _keep_foreign(cfg: DictConfig) -> None:
    existing = load_manifest(dataset_dir(cfg) / MANIFEST)
    if existing is not None:
        refuse_foreign_tokenizer(cfg, dataset_dir(cfg) / MANIFEST, existing)


def check_source(data_cfg) -> None:
    """What preparing (without --force) would refuse, as far as that needs no download: a dataset
    of another tokenizer or another source in the way, an unknown dataset, a data.source without text
    (a sweep checks each point's so before any point prepares)."""
    cfg = with_recorded_source(as_data_cfg(data_cfg))
    _keep_foreign(cfg)
    refuse_other_source(cfg)
    if not sources.downloads(cfg):
        sources.open_source(cfg)


def _num_proc(cfg: DictConfig) -> int:
    return max(1, int(cfg.num_proc or os.cpu_count() or 1))




@contextlib.contextmanager
def _locked(root: Path):
    """One prepare per dataset folder at a time (ranks or shells racing each other wait here). The
    lock file goes again with the prepare that made it, so a folder is left as it was found; a
    waiter that then holds the lock of a removed file takes the lock again on the current one."""
    path = root / ".lock"
    while True:
        try:
            fd, made = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), True
        except FileExistsError:
            fd, made = os.open(path, os.O_WRONLY | os.O_CREAT), False
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        if made:
            path.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


def _publish(root: Path, tmp: Path, manifest: dict) -> None:
    """Swap the new shards in; the dataset is invalid (no manifest) until the last rename."""
    (root / MANIFEST).unlink(missing_ok=True)
    for old in list(root.glob("train_*.bin")) + list(root.glob("val_*.bin")):
        old.unlink()
    for entries in manifest["splits"].values():
        for e in entries:
            os.replace(tmp / e["file"], root / e["file"])
    staged = tmp / MANIFEST
    staged.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(staged, root / MANIFEST)


def _progress(enabled: bool | None, total: int | None):
    console = Console(stderr=True)
    if enabled is None:
        enabled = console.is_terminal
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def prepare(data_cfg, force: bool = False, progress: bool | None = None, files: bool = True) -> Path:
    """Tokenize ``data_cfg``'s dataset into shards; the manifest path.

    A dataset already prepared with the same settings (and, when the config names its source and
    ``files``, from the same files as they are now) is left alone unless ``force``. Another source
    than the one data.name was prepared from is refused unless ``force``. ``progress``: show a rich
    bar on stderr (None = only when stderr is a terminal).
    """
    cfg = as_data_cfg(data_cfg)
    source_named = files and names_source(cfg)
    cfg = with_recorded_source(cfg)  # data.name alone: the text it was prepared from
    root = dataset_dir(cfg)
    if not force:  # another tokenizer's dataset, or another source's, is not overwritten unasked
        _keep_foreign(cfg)
        refuse_other_source(cfg)
    if not force and _up_to_date(cfg, source_named):
        return root / MANIFEST
    if cfg.shard_tokens < 1:
        raise DataError(f"data.shard_tokens={cfg.shard_tokens} must be at least 1")
    if not 0 <= cfg.val_fraction < 1:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    if cfg.max_tokens is not None and cfg.max_tokens < MIN_TOKENS:
        raise DataError(f"data.max_tokens={cfg.max_tokens} keeps no text (the stream opens with the end-of-text "
                        f"marker before the first document); set data.max_tokens={MIN_TOKENS} or more (one "
                        "training step needs micro_batch_size x seq_len x world x accumulation + 1), or null for all")
    check_writable_dir(root, f"data.dir={cfg.dir}", "set data.dir to a writable folder")
    made = first_missing(root)  # removed again when this prepare fails: a failure leaves nothing
    try:
        with write_errors_as_user_errors(root, "set data.dir to a writable folder"):
            root.mkdir(parents=True, exist_ok=True)
            with _locked(root):
                if not force and _up_to_date(cfg, source_named):  # someone else just did it
                    return root / MANIFEST
                with rewriting(root, "prepare into another data.name="):  # never under a live run's feet
                    for stale in root.glob(".prepare-*"):  # left by an interrupted run (we hold the lock)
                        shutil.rmtree(stale, ignore_errors=True)
                    source = sources.open_source(cfg)
                    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".prepare-"))
                    try:
                        manifest = _build(cfg, source, tmp, progress)
                        _publish(root, tmp, manifest)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return root / MANIFEST


def _build(cfg: DictConfig, source: sources.Source, tmp: Path, progress: bool | None) -> dict:
    tok = load_tokenizer(cfg.tokenizer)
    dtype = shard_dtype(tok.vocab_size)
    writer = StreamWriter(tmp, cfg.shard_tokens, DTYPES[dtype])
    max_tokens = cfg.max_tokens
    documents = 0
    by_tokens = source.size_hint is None and max_tokens is not None
    bar = _progress(progress, max_tokens if by_tokens else source.size_hint)
    num_proc = _num_proc(cfg)
    if source.size_hint is not None and source.size_hint <= PIECE_CHARS:
        num_proc = 1  # one task's worth of text: a pool would only add start-up time
    spec = {"name": tok.name, "path": tok.path}
    with encoding_pool(num_proc, spec) as run, bar:  # fork the pool before rich starts its thread
        task = bar.add_task(
            f"tokenizing {cfg.name}", total=max_tokens if by_tokens else source.size_hint, tokens=0
        )
        for tokens, chars in run(piece_batches(source.documents(), cut_documents=tok.cuts_documents)):
            if max_tokens is not None and writer.total + len(tokens) > max_tokens:
                tokens = tokens[: max_tokens - writer.total]
            writer.write(tokens)
            documents += int(np.count_nonzero(tokens == tok.eot))
            bar.update(task, advance=len(tokens) if by_tokens else chars, tokens=writer.total)
            if max_tokens is not None and writer.total >= max_tokens:
                break
    writer.close()
    total = writer.total
    if total == documents:  # nothing but the end-of-text token before each (empty) document
        if max_tokens is not None and total >= max_tokens:
            raise DataError(f"data.max_tokens={max_tokens} keeps only the end-of-text markers of {documents} "
                            f"empty document(s) at the start of {source.description}; raise data.max_tokens (or null "
                            "for all)")
        raise DataError(f"dataset {cfg.name!r} has no text (source {source.description}: {documents} empty "
                        "document(s)); check data.source")
    train, val = split_stream(writer, val_token_count(total, cfg.val_fraction), tmp, cfg.shard_tokens)
    splits = {
        name: [{"file": p.name, "tokens": n, "sha256": sha256_file(p)} for p, n in shards]
        for name, shards in (("train", train), ("val", val))
    }
    return {
        "format": FORMAT,
        "dataset": cfg.name,
        **tok.identity,  # tokenizer, vocab_size, eot, tokenizer_fingerprint
        "tokenizer_path": tok.path,
        "dtype": dtype,
        "source": source.description,
        "source_identity": source.identity,
        "splits": splits,
        "documents": documents,
        "tokens": total,
        "settings": settings_of(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
