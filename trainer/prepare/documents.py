"""Documents held as records, one field of each the text (data.text_field): local .parquet / .jsonl
/ .json files read by dtrain itself (pyarrow for parquet), .txt files one document each, and
Hugging Face datasets streamed through the optional `datasets` package (dtrain[fineweb]).

Each reader checks the field where the records are first seen (a missing field is one line naming
the fields there are) and yields the non-empty texts in file and record order.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from trainer.config.dataset_names import RECORD_SUFFIXES
from trainer.errors import DataError
from trainer.fetch.hub import OFFLINE_SET, hub_unreachable
from trainer.io import one_line

EXTRA = "pip install 'dtrain[fineweb]'"  # the extra that brings `datasets` (and pyarrow)
_SHOWN_FIELDS = 12  # a message lists at most this many of the fields there are


def read_text_file(path: Path) -> str:
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


def _fields(names) -> str:
    names = [str(n) for n in names]
    more = f" and {len(names) - _SHOWN_FIELDS} more" if len(names) > _SHOWN_FIELDS else ""
    return (", ".join(names[:_SHOWN_FIELDS]) + more) or "none"


def missing_field(where: str, field: str, names) -> DataError:
    names = list(names)
    hint = f", e.g. data.text_field={names[0]}" if len(names) == 1 else ""
    return DataError(f"{where} has no {field!r} field (its fields: {_fields(names)}); set data.text_field to the "
                     f"one that holds the text{hint}")


def _text_of(record, field: str, where: str) -> str | None:
    if not isinstance(record, dict):
        raise DataError(f"{where} is {type(record).__name__}, not a record with a {field!r} field; fix the file "
                        "or leave it out")
    if field not in record:
        raise missing_field(where, field, record)
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} holds {type(text).__name__}, not text; set data.text_field to a "
                        "field of strings")
    return text


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_texts(path: Path, field: str) -> Iterator[str]:
    """JSON lines, or one JSON array of records (a .json file that opens with '[')."""
    try:
        with _open_text(path) as f:
            head = f.read(1 << 16).lstrip()
            f.seek(0)
            if head.startswith("["):
                rows = json.load(f)
                for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
                    text = _text_of(row, field, f"{path} record {i}")
                    if text:
                        yield text
                return
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno} is not JSON ({one_line(e)}); fix the file or leave it out") from e
                text = _text_of(row, field, f"{path}:{lineno}")
                if text:
                    yield text
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read {path} ({type(e).__name__}: {one_line(e)}); fix the file or leave it out") from e
    except ValueError as e:  # a JSON array that does not parse
        raise DataError(f"{path} is not JSON ({one_line(e)}); fix the file or leave it out") from e


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq  # optional (dtrain[fineweb]): only parquet files need it
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow; `{EXTRA}` or convert it to .jsonl") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a damaged or foreign file
        raise DataError(f"cannot read {path} as parquet ({type(e).__name__}: {one_line(e)}); fix the file or "
                        "leave it out") from e


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    pf = _parquet_file(path)
    if field not in pf.schema_arrow.names:
        raise missing_field(str(path), field, pf.schema_arrow.names)
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        column = batch.column(0)
        if not (column.type.equals("string") or column.type.equals("large_string")):
            raise DataError(f"{path}: column {field!r} holds {column.type}, not text; set data.text_field to a "
                            "column of strings")
        for text in column.to_pylist():
            if text:
                yield text


def file_documents(files: list[Path], field: str) -> Iterator[str]:
    """The documents of local files in order: each record's `field`, or a whole .txt file."""
    for f in files:
        name = f.name.lower()
        if name.endswith(".parquet"):
            yield from _parquet_texts(f, field)
        elif name.endswith(RECORD_SUFFIXES):
            yield from _json_texts(f, field)
        else:
            yield read_text_file(f)


def check_files(files: list[Path], field: str) -> None:
    """Read up to the first record of the first record file: a missing field is one line now, before
    anything is written, not after minutes of tokenizing."""
    for f in files:
        if f.name.lower().endswith(RECORD_SUFFIXES):
            next(iter(file_documents([f], field)), None)
            return


# ------------------------------------------------------------------------------ Hugging Face


def import_datasets(what: str):
    """The optional `datasets` package; imported here, not at the top, because only the Hub stream
    needs it and it is slow to import."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what} streams from Hugging Face with the `datasets` package; `{EXTRA}`, or read local "
                        "files: data.hf_path=<a folder, file or glob of .parquet/.jsonl/.txt>") from None
    return datasets


def describe(path: str, name: str | None, split: str) -> str:
    return f"{path}" + (f" ({name})" if name else "") + f" split {split}"


def _reach_hint(out_of_reach: str | None) -> str:
    if out_of_reach == OFFLINE_SET:
        return "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set, so nothing is fetched from the Hub: unset it"
    if out_of_reach:
        return (f"the Hub is out of reach ({out_of_reach}): check network access (HTTPS_PROXY for a proxy, "
                "HF_ENDPOINT for a mirror)")
    return ("check data.hf_path, data.hf_name, data.hf_split and network access (HF_TOKEN for a gated dataset; "
            "HF_HUB_OFFLINE=1 fails at once instead of retrying)")


def hub_rows(path: str, name: str | None, split: str):
    """Rows of a Hub dataset as `datasets` streams them; any failure (network, auth, an unknown
    dataset, configuration or split) is one line naming the dataset and the way to local files."""
    # Asked before `datasets` is imported (the Hub's clients read offline mode then): offline, the
    # stream fails at once instead of after half a minute of retries.
    out_of_reach = None if "datasets" in sys.modules else hub_unreachable()
    datasets = import_datasets(f"data.hf_path={path}")
    try:
        yield from datasets.load_dataset(path, name=name, split=split, streaming=True)
    except Exception as e:  # network, auth, unknown dataset / config / split: each one line
        raise DataError(
            f"cannot stream {describe(path, name, split)} from Hugging Face ({type(e).__name__}: {one_line(e)[:300]}); "
            f"{_reach_hint(out_of_reach)}; or download its files (`hf download --repo-type dataset {path} "
            "--local-dir DIR`) and set data.hf_path=DIR"
        ) from e


def hub_documents(path: str, name: str | None, split: str, field: str) -> Iterator[str]:
    where = describe(path, name, split)
    for i, row in enumerate(hub_rows(path, name, split)):
        text = _text_of(row, field, f"{where} row {i}")
        if text:
            yield text


def check_hub(path: str, name: str | None, split: str, field: str) -> None:
    """Reach the dataset and read its first row: an unreachable Hub, an unknown dataset or a missing
    field is one line before anything is tokenized or written."""
    row = next(iter(hub_rows(path, name, split)), None)
    if row is not None:
        _text_of(row, field, f"{describe(path, name, split)} row 0")
