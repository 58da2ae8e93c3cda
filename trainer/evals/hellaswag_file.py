"""HellaSwag's file, without torch: read, found (eval.hellaswag.path) or downloaded and cached,
and checked before a run or an evaluation writes anything.

The file is HellaSwag's public jsonl: one object per line with ``ctx`` (the context), ``endings``
(4 candidate continuations) and ``label`` (the index of the right one). trainer/evals/hellaswag.py
scores it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console

from trainer.errors import DataError
from trainer.fetch.downloads import download
from trainer.io import one_line, sha256_file, write_atomic

N_ENDINGS = 4
FIELDS = ("ctx", "endings", "label")
DEFAULT_FILE_NAME = "hellaswag_val.jsonl"


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]
    label: int


def _parse_row(row, where: str) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with {', '.join(FIELDS)}, got {type(row).__name__}")
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise DataError(
            f"{where}: missing field {', '.join(repr(k) for k in missing)} (a HellaSwag line needs "
            f"{', '.join(FIELDS)}); fix the file or point eval.hellaswag.path at another"
        )
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if not isinstance(ctx, str):
        raise DataError(f"{where}: field 'ctx' must be a string, got {type(ctx).__name__}")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS
            and all(isinstance(e, str) for e in endings)):
        raise DataError(f"{where}: field 'endings' must be a list of {N_ENDINGS} strings")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)  # some HellaSwag exports store the label as a string
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < N_ENDINGS:
        raise DataError(f"{where}: field 'label' must be an integer in 0..{N_ENDINGS - 1}, got {label!r}")
    return Example(ctx, tuple(endings), label)


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """The examples of a HellaSwag jsonl file, in file order (the first ``limit`` when given).

    A line that is not valid JSON or lacks a field raises DataError naming the file and line.
    """
    path = Path(path)
    examples: list[Example] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(examples) >= limit:
                    break
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{where}: not valid JSON ({e.msg} at column {e.colno}); fix the file or point "
                        "eval.hellaswag.path at another"
                    ) from None
                examples.append(_parse_row(row, where))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read {path} ({one_line(e.strerror or e)}); fix eval.hellaswag.path") \
            from None
    if not examples:
        raise DataError(f"{path} holds no HellaSwag examples; point eval.hellaswag.path at a jsonl file")
    return examples


def cache_path(hs_cfg, data_dir: str) -> Path:
    """Where the download is cached: <data.dir>/hellaswag/<file name of the URL>."""
    name = Path(urlparse(hs_cfg.url).path).name or DEFAULT_FILE_NAME
    return Path(os.path.expanduser(str(data_dir))) / "hellaswag" / name


def hellaswag_file(hs_cfg, data_dir: str) -> Path:
    """The local HellaSwag file: eval.hellaswag.path, or the URL's download cached under data_dir.

    With eval.hellaswag.sha256 set, the file must match it. Without, the first download's sha256 is
    recorded beside the cached copy (``<file>.sha256``) and later runs check the copy against it
    (a corrupt or stale copy is fetched again).
    """
    expected = hs_cfg.sha256
    if hs_cfg.path:
        path = Path(os.path.expanduser(str(hs_cfg.path))).absolute()
        if not path.is_file():
            raise DataError(
                f"eval.hellaswag.path={hs_cfg.path} is not a file; point it at a HellaSwag jsonl file or "
                f"drop it to download {hs_cfg.url}"
            )
        if expected:
            digest = sha256_file(path)
            if digest != expected:
                raise DataError(
                    f"{path} has sha256 {digest}, expected eval.hellaswag.sha256={expected}; fix the "
                    "file or eval.hellaswag.sha256"
                )
        return path
    return fetch(hs_cfg.url, cache_path(hs_cfg, data_dir), expected)


def fetch(url: str, dest: Path, sha256: str | None = None) -> Path:
    """Download url to dest unless a verified copy is there; record its sha256 in dest.sha256."""
    record = dest.with_name(dest.name + ".sha256")
    if dest.exists():
        recorded = record.read_text().split()[0] if record.exists() else None
        want = sha256 or recorded
        digest = sha256_file(dest)
        if want is None or digest == want:
            if recorded != digest:
                write_atomic(record, f"{digest}  {dest.name}\n")
            return dest
        dest.unlink(missing_ok=True)  # a stale or corrupt copy: fetch it again
    try:
        download(url, dest, None)
    except DataError as e:
        cause = e.__cause__
        reason = one_line(getattr(cause, "reason", cause) if cause is not None else e)
        raise DataError(
            f"cannot download HellaSwag from {url} ({reason}); check network access, or download it "
            "yourself and set eval.hellaswag.path=<local jsonl file>"
        ) from None
    digest = sha256_file(dest)
    if sha256 and digest != sha256:
        dest.unlink(missing_ok=True)
        raise DataError(
            f"{url} downloaded with sha256 {digest}, expected eval.hellaswag.sha256={sha256}; fix "
            "eval.hellaswag.sha256 (or set it to null) or set eval.hellaswag.path=<local file>"
        )
    write_atomic(record, f"{digest}  {dest.name}\n")
    if not sha256:
        Console(stderr=True).print(
            f"downloaded {url} to {dest} (sha256 {digest}, recorded in {record.name}; set "
            "eval.hellaswag.sha256 to pin it)", highlight=False, soft_wrap=True)
    return dest


def check_hellaswag_file(cfg, download_now: bool = True) -> None:
    """A run that scores HellaSwag while it trains (eval.hellaswag.interval > 0) finds its file before
    the run directory is made: eval.hellaswag.path is there (and matches eval.hellaswag.sha256), or
    the download is fetched now (`download_now`; a sweep's points are checked before any of them
    runs, and each fetches it when it starts). DataError in one line otherwise."""
    hs_cfg = cfg.eval.hellaswag
    if hs_cfg.interval > 0 and (hs_cfg.path or download_now):
        hellaswag_file(hs_cfg, cfg.data.dir)
