"""Opening prepared shards: memmaps, and every way a dataset on disk can be wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data import shard_reader
from trainer.errors import DataError
from trainer.prepare import pipeline as P
from trainer.tokenizers.gpt2 import EOT
from trainer.tokenizers.load import shard_dtype

TEXT = "".join(f"Line {i}: the quality of mercy is not strained.\n" for i in range(3000))


@pytest.fixture
def cfg(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    c = P.as_data_cfg(
        {
            "name": "text",
            "dir": str(tmp_path / "data"),
            "source": str(src),
            "val_fraction": 0.1,
            "shard_tokens": 20_000,
        }
    )
    P.prepare(c)
    return c


def test_open_split_returns_readonly_memmaps(cfg):
    train, val = shard_reader.open_split(cfg, "train"), shard_reader.open_split(cfg, "val")
    m = shard_reader.read_manifest(cfg)
    assert len(train) == len(m["splits"]["train"]) > 1
    for mm in train + val:
        assert isinstance(mm, np.memmap) and mm.dtype == np.uint16 and not mm.flags.writeable
    assert train[0][0] == EOT
    train_tokens = sum(int(e["tokens"]) for e in m["splits"]["train"])
    assert sum(len(x) for x in train + val) == m["tokens"] == train_tokens + len(val[0])


def test_missing_manifest_hints_prepare(tmp_path):
    c = P.as_data_cfg({"name": "tinyshakespeare", "dir": str(tmp_path)})
    with pytest.raises(DataError) as e:
        shard_reader.open_split(c, "train")
    msg = str(e.value)
    assert "not prepared" in msg and str(tmp_path / "tinyshakespeare") in msg
    assert f"dtrain prepare data=tinyshakespeare data.dir={tmp_path}" in msg and "\n" not in msg


def test_flipped_byte_fails_sha256(cfg):
    path = P.dataset_dir(cfg) / "train_000001.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        shard_reader.open_split(cfg, "train")
    msg = str(e.value)
    assert "train_000001.bin" in msg and "sha256" in msg and "--force" in msg
    cfg.verify = "size"  # size-only checking does not read the data
    assert len(shard_reader.open_split(cfg, "train")) > 1
    cfg.verify = "sha256"
    with pytest.raises(DataError, match="sha256"):
        shard_reader.open_split(cfg, "train")


def test_truncated_shard_fails_size(cfg):
    path = P.dataset_dir(cfg) / "val_000000.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DataError, match="size") as e:
        shard_reader.open_split(cfg, "val")
    assert "val_000000.bin" in str(e.value) and "dtrain prepare data=text" in str(e.value)


def test_missing_shard_and_bad_manifest(cfg):
    root = P.dataset_dir(cfg)
    (root / "train_000000.bin").unlink()
    with pytest.raises(DataError, match="missing"):
        shard_reader.open_split(cfg, "train")
    (root / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable"):
        shard_reader.read_manifest(cfg)
    (root / "manifest.json").write_text(json.dumps({"format": 99, "splits": {}}))
    with pytest.raises(DataError, match="format"):
        shard_reader.read_manifest(cfg)


def test_empty_or_unknown_split(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text(TEXT[:5000])
    c = P.as_data_cfg({"name": "text", "dir": str(tmp_path), "source": str(src), "val_fraction": 0.0})
    P.prepare(c)
    with pytest.raises(DataError, match="val_fraction"):
        shard_reader.open_split(c, "val")
    with pytest.raises(DataError, match="no 'test' split"):
        shard_reader.open_split(c, "test")
    c.verify = "sometimes"
    with pytest.raises(DataError, match="data.verify"):
        shard_reader.open_split(c, "train")


def test_the_dtype_holds_the_vocabulary():
    assert (shard_dtype(50_257), shard_dtype(65_536), shard_dtype(65_537), shard_dtype(151_936)) == \
        ("uint16", "uint16", "uint32", "uint32")  # needs no tokenizers package: not in a module that skips without it
