"""Tokenize a dataset into uint16 shards plus a manifest.

Layout of ``<data.dir>/<data.name>/``::

    manifest.json          written last; its presence is what makes the dataset valid
    train_000000.bin ...   raw little-endian uint16 GPT-2 token ids, at most data.shard_tokens each
    val_000000.bin ...
    raw/                   cached downloads (source archives), kept across re-prepares

The token stream is ``EOT doc0 EOT doc1 ...`` (EOT = 50256 separates documents). The validation
split is the last ``val_fraction`` of the stream (cut at a token), train is the rest, so a
dataset of a single document still gets both splits.

Tokenizing runs in a process pool over ~0.5 MB pieces of text. Long documents are cut at line
breaks whose neighbours are not whitespace; GPT-2's pre-tokenizer always splits there, so the
pieces encode to exactly the tokens of the whole document.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from trainer.data import sources
from trainer.data.sources import sha256_file as _sha256_file
from trainer.data.tokenizer import EOT, VOCAB_SIZE, gpt2_encoding
from trainer.errors import DataError

MANIFEST = "manifest.json"
FORMAT = 1
DTYPE = np.dtype("<u2")
PIECE_CHARS = 1 << 19  # text per pool task (and the size long documents are cut to)
SETTINGS_KEYS = (
    "source",
    "sha256",
    "val_fraction",
    "shard_tokens",
    "max_tokens",
    "hf_path",
    "hf_name",
    "hf_split",
)
_EOT_ARRAY = np.array([EOT], dtype=DTYPE)


# ------------------------------------------------------------------------------------- config


def as_data_cfg(data_cfg) -> DictConfig:
    """Accept a DictConfig (cfg.data), a DataConfig dataclass or a plain dict of DataConfig keys."""
    from trainer.config import DataConfig

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
    return OmegaConf.create(values)


def dataset_dir(data_cfg) -> Path:
    """``<data.dir>/<data.name>`` with ``~`` expanded."""
    cfg = as_data_cfg(data_cfg)
    return Path(os.path.expanduser(str(cfg.dir))) / cfg.name


def manifest_path(data_cfg) -> Path:
    return dataset_dir(data_cfg) / MANIFEST


def default_data_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("DTRAIN_DATA_DIR") or "~/.cache/dtrain/data"))


def prepare_command(data_cfg, force: bool = False) -> str:
    """The ``dtrain prepare ...`` line that (re)builds this dataset, for error messages."""
    cfg = as_data_cfg(data_cfg)
    parts = ["dtrain", "prepare"]
    if cfg.name in sources.DATASETS:
        parts.append(f"data={cfg.name}")
    else:
        parts += ["data=text", f"data.name={cfg.name}"]
    if cfg.source:
        parts.append(f"data.source={cfg.source}")
    data_dir = Path(os.path.expanduser(str(cfg.dir)))
    if data_dir.resolve() != default_data_dir().resolve():
        parts.append(f"data.dir={cfg.dir}")
    if force:
        parts.append("--force")
    return shlex.join(parts)


def settings_of(data_cfg) -> dict:
    """The config values a prepared dataset depends on (recorded in the manifest)."""
    cfg = as_data_cfg(data_cfg)
    out = {k: cfg[k] for k in SETTINGS_KEYS}
    if out["source"]:
        out["source"] = sources.resolve_local(out["source"])
    return out


# ----------------------------------------------------------------------------------- manifest


def load_manifest(path: Path) -> dict | None:
    """The parsed manifest, or None when it is missing or unreadable."""
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("splits"), dict):
        return None
    return m


def _files_intact(root: Path, manifest: dict) -> bool:
    for entries in manifest["splits"].values():
        for e in entries:
            p = root / e["file"]
            if not p.is_file() or p.stat().st_size != e["tokens"] * DTYPE.itemsize:
                return False
    return True


def is_prepared(data_cfg) -> bool:
    """A manifest with the current settings exists and every shard has its recorded size."""
    cfg = as_data_cfg(data_cfg)
    root = dataset_dir(cfg)
    m = load_manifest(root / MANIFEST)
    if m is None or m.get("settings") != settings_of(cfg):
        return False
    try:
        return _files_intact(root, m)
    except (KeyError, TypeError):
        return False


# ------------------------------------------------------------------------------- tokenizing


def _safe_cut(text: str, lo: int, hi: int) -> int:
    """A cut in [lo, hi] just after a newline with non-space on both sides, or -1."""
    while hi > lo:
        j = text.rfind("\n", lo, hi)
        if j < 1:
            return -1
        if j + 1 < len(text) and not text[j - 1].isspace() and not text[j + 1].isspace():
            return j + 1
        hi = j
    return -1


def split_document(text: str, max_chars: int = PIECE_CHARS) -> Iterator[str]:
    """Cut a long document into pieces of about ``max_chars`` whose encodings concatenate to the
    document's. A cut falls just after a newline with non-whitespace on both sides (GPT-2's
    pre-tokenizer always breaks there); a document without such a line break is cut hard."""
    start, n = 0, len(text)
    while n - start > max_chars:
        cut = _safe_cut(text, start + max_chars // 2, start + max_chars)
        if cut < 0:
            cut = _safe_cut(text, start + 1, start + max_chars // 2)
        if cut < 0:
            cut = start + max_chars
        yield text[start:cut]
        start = cut
    if start < n or n == 0:
        yield text[start:]


def _tasks(docs: Iterable[str], task_chars: int = PIECE_CHARS) -> Iterator[list[tuple[bool, str]]]:
    """Batches of (starts_a_document, text) of about ``task_chars`` characters."""
    batch, size = [], 0
    for doc in docs:
        for i, piece in enumerate(split_document(doc, task_chars)):
            batch.append((i == 0, piece))
            size += len(piece)
            if size >= task_chars:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _encode_task(task: list[tuple[bool, str]]) -> tuple[np.ndarray, int]:
    enc = gpt2_encoding()
    parts, chars = [], 0
    for starts_doc, piece in task:
        if starts_doc:
            parts.append(_EOT_ARRAY)
        # encode_to_numpy with no special tokens allowed == encode_ordinary, without a Python list
        parts.append(enc.encode_to_numpy(piece, disallowed_special=()).astype(DTYPE))
        chars += len(piece)
    return (np.concatenate(parts) if parts else np.empty(0, DTYPE)), chars


def _init_worker() -> None:
    gpt2_encoding()


def _pool_context():
    # Not fork: forking a process that already runs threads (torch's, tiktoken's, pytest's) can
    # leave a lock held in the child forever (seen: a tokenizer worker stuck on a futex).
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        # The server imports this module once; each worker forks from it with the module (and
        # numpy, tiktoken) loaded instead of importing them again.
        context.set_forkserver_preload([__name__])
        return context
    return mp.get_context("spawn")


@contextlib.contextmanager
def _encoder(num_proc: int):
    """Yields ``run(tasks) -> iterator of (tokens, chars)`` in order, ``num_proc`` processes."""
    gpt2_encoding()  # load (or fetch) once here, so forked workers inherit it and errors surface early
    if num_proc <= 1:
        yield lambda tasks: (_encode_task(t) for t in tasks)
        return
    pool = _pool_context().Pool(num_proc, initializer=_init_worker)

    def run(tasks):
        pending = collections.deque()
        for t in tasks:
            pending.append(pool.apply_async(_encode_task, (t,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    try:
        yield run
    finally:
        pool.terminate()
        pool.join()


def _num_proc(cfg) -> int:
    return max(1, int(cfg.num_proc or os.cpu_count() or 1))


# ----------------------------------------------------------------------------------- writing


class _StreamWriter:
    """Appends tokens to ``stream_NNNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, shard_tokens: int):
        self.folder, self.shard_tokens = folder, shard_tokens
        self.files: list[tuple[Path, int]] = []  # (path, tokens), in stream order
        self._f = None
        self.total = 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._f is None or self.files[-1][1] >= self.shard_tokens:
                self._open_next()
            path, count = self.files[-1]
            take = min(len(tokens), self.shard_tokens - count)
            self._f.write(tokens[:take].tobytes())
            self.files[-1] = (path, count + take)
            self.total += take
            tokens = tokens[take:]

    def _open_next(self) -> None:
        if self._f is not None:
            self._f.close()
        path = self.folder / f"stream_{len(self.files):06d}.bin"
        self._f = open(path, "wb", buffering=1 << 22)
        self.files.append((path, 0))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _copy_range(writer: _StreamWriter, start: int, stop: int, out: Path, prefix: str, shard_tokens: int):
    """Copy stream tokens [start, stop) into ``<prefix>_NNNNNN.bin`` shards; their (path, tokens)."""
    shards, f, count = [], None, 0
    base = 0
    for path, n in writer.files:
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            mm = np.memmap(path, dtype=DTYPE, mode="r")
            pos = lo
            while pos < hi:
                if f is None or count >= shard_tokens:
                    if f is not None:
                        f.close()
                        shards[-1] = (shards[-1][0], count)
                    shards.append((out / f"{prefix}_{len(shards):06d}.bin", 0))
                    f, count = open(shards[-1][0], "wb"), 0
                take = min(hi - pos, shard_tokens - count, 1 << 24)
                f.write(mm[pos - base : pos - base + take].tobytes())
                pos += take
                count += take
            del mm
        base += n
    if f is not None:
        f.close()
        shards[-1] = (shards[-1][0], count)
    return shards


def _split_stream(writer: _StreamWriter, n_val: int, out: Path, shard_tokens: int):
    """Turn the stream files into train shards (all but the last n_val tokens) and val shards."""
    cut = writer.total - n_val
    val = _copy_range(writer, cut, writer.total, out, "val", shard_tokens)
    train, base = [], 0
    for path, n in writer.files:
        keep = min(n, max(0, cut - base))
        if keep:
            if keep < n:
                os.truncate(path, keep * DTYPE.itemsize)
            final = out / f"train_{len(train):06d}.bin"
            os.replace(path, final)
            train.append((final, keep))
        else:
            path.unlink()
        base += n
    return train, val


@contextlib.contextmanager
def _locked(root: Path):
    """One prepare per dataset folder at a time (ranks or shells racing each other wait here)."""
    import fcntl

    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

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


def prepare(data_cfg, force: bool = False, progress: bool | None = None) -> Path:
    """Tokenize ``data_cfg``'s dataset into shards; the manifest path.

    A dataset already prepared with the same settings is left alone unless ``force``. ``progress``:
    show a rich bar on stderr (None = only when stderr is a terminal).
    """
    cfg = as_data_cfg(data_cfg)
    root = dataset_dir(cfg)
    if not force and is_prepared(cfg):
        return root / MANIFEST
    if cfg.shard_tokens < 1:
        raise DataError(f"data.shard_tokens={cfg.shard_tokens} must be at least 1")
    if not 0 <= cfg.val_fraction < 1:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1)")
    if cfg.max_tokens is not None and cfg.max_tokens < 1:
        raise DataError(f"data.max_tokens={cfg.max_tokens} must be at least 1 (or null for all)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create {root} ({e.strerror}); set data.dir to a writable folder") from e
    with _locked(root):
        if not force and is_prepared(cfg):  # someone else just did it
            return root / MANIFEST
        for stale in root.glob(".prepare-*"):  # left by an interrupted run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        source = sources.open_source(cfg)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".prepare-"))
        try:
            manifest = _build(cfg, source, tmp, progress)
            _publish(root, tmp, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root / MANIFEST


def _build(cfg, source: sources.Source, tmp: Path, progress: bool | None) -> dict:
    writer = _StreamWriter(tmp, cfg.shard_tokens)
    max_tokens = cfg.max_tokens
    documents = 0
    by_tokens = source.size_hint is None and max_tokens is not None
    bar = _progress(progress, max_tokens if by_tokens else source.size_hint)
    num_proc = _num_proc(cfg)
    if source.size_hint is not None and source.size_hint <= PIECE_CHARS:
        num_proc = 1  # one task's worth of text: a pool would only add start-up time
    with _encoder(num_proc) as run, bar:  # fork the pool before rich starts its thread
        task = bar.add_task(
            f"tokenizing {cfg.name}", total=max_tokens if by_tokens else source.size_hint, tokens=0
        )
        for tokens, chars in run(_tasks(source.documents())):
            if max_tokens is not None and writer.total + len(tokens) > max_tokens:
                tokens = tokens[: max_tokens - writer.total]
            writer.write(tokens)
            documents += int(np.count_nonzero(tokens == EOT))
            bar.update(task, advance=len(tokens) if by_tokens else chars, tokens=writer.total)
            if max_tokens is not None and writer.total >= max_tokens:
                break
    writer.close()
    total = writer.total
    if total == 0:
        raise DataError(f"dataset {cfg.name!r} has no text (source {source.description}); check data.source")
    n_val = int(round(total * cfg.val_fraction))
    if cfg.val_fraction > 0:
        n_val = max(1, n_val)
    n_val = min(n_val, total - 1)
    train, val = _split_stream(writer, n_val, tmp, cfg.shard_tokens)
    splits = {
        name: [{"file": p.name, "tokens": n, "sha256": _sha256_file(p)} for p, n in shards]
        for name, shards in (("train", train), ("val", val))
    }
    return {
        "format": FORMAT,
        "dataset": cfg.name,
        "tokenizer": "gpt2",
        "dtype": "uint16",
        "eot": EOT,
        "vocab_size": VOCAB_SIZE,
        "source": source.description,
        "splits": splits,
        "documents": documents,
        "tokens": total,
        "settings": settings_of(cfg),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
