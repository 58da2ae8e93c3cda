"""GPT-2 tokenizer: ids, round trip, the offline cache and its verification."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import tiktoken

from trainer.errors import DataError, UserError
from trainer.tokenizers import gpt2
from trainer.tokenizers.gpt2 import EOT, VOCAB_SIZE, gpt2_encoding


@pytest.fixture(scope="session")
def real_tiktoken_file():
    """A verified gpt2.tiktoken in the shared cache (DTRAIN_CACHE_DIR or ~/.cache/dtrain), fetched
    at most once: through the normal path, which falls back to PyPI on a fresh machine."""
    gpt2_encoding()
    path = gpt2.cached_ranks_path()
    if not path.exists():  # the encoding came from tiktoken's own download: keep a file copy too
        gpt2.fetch_from_pypi(path)
    return path


@pytest.fixture
def fresh_encoding():
    """Forget the per-process encoding before and after the test (which changes the cache env)."""
    gpt2_encoding.cache_clear()
    yield
    gpt2_encoding.cache_clear()


def test_known_ids_and_constants():
    enc = gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert EOT == 50256 and VOCAB_SIZE == 50257
    assert enc.n_vocab == VOCAB_SIZE
    assert enc.eot_token == EOT
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    # as plain text the special marker is NOT the EOT id
    assert EOT not in gpt2.encode("<|endoftext|>")


def test_round_trip():
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak. ünïcödé 🙂\n"
    ids = gpt2.encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert gpt2.decode(ids) == text


def test_cached_per_process():
    assert gpt2_encoding() is gpt2_encoding()


def test_offline_from_verified_copy(tmp_path, monkeypatch, real_tiktoken_file, fresh_encoding):
    shutil.copy(real_tiktoken_file, tmp_path / "gpt2.tiktoken")
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")

    def no_network(*a, **k):
        raise AssertionError("network used")

    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    monkeypatch.setattr(subprocess, "run", no_network)
    enc = gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.decode(enc.encode_ordinary("To be, or not to be")) == "To be, or not to be"


def test_corrupt_cached_file_is_rejected(tmp_path, monkeypatch, real_tiktoken_file, fresh_encoding):
    data = bytearray(real_tiktoken_file.read_bytes())
    data[100] ^= 1
    (tmp_path / "gpt2.tiktoken").write_bytes(bytes(data))
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        gpt2_encoding()
    msg = str(e.value)
    assert "gpt2.tiktoken" in msg and "delete it" in msg and "\n" not in msg
    assert isinstance(e.value, UserError)


def test_all_sources_fail_gives_one_line_fix(tmp_path, monkeypatch, fresh_encoding):
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")

    def pip_fails(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\nno network\n")

    monkeypatch.setattr(subprocess, "run", pip_fails)
    with pytest.raises(DataError) as e:
        gpt2_encoding()
    msg = str(e.value)
    assert str(tmp_path / "empty" / "gpt2.tiktoken") in msg
    assert "PyPI" in msg and "\n" not in msg


def test_pypi_fallback_writes_verified_file(tmp_path, monkeypatch, real_tiktoken_file, fresh_encoding):
    """Path (c) without the network: a fake `pip download` producing a whisper-like sdist."""
    import io
    import tarfile

    def fake_pip(cmd, **kwargs):
        dest = cmd[cmd.index("-d") + 1]
        with tarfile.open(f"{dest}/{gpt2.WHISPER_SDIST}", "w:gz") as tar:
            data = real_tiktoken_file.read_bytes()
            info = tarfile.TarInfo("openai_whisper-20250625/whisper/assets/gpt2.tiktoken")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")
    monkeypatch.setattr(subprocess, "run", fake_pip)
    enc = gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (tmp_path / "gpt2.tiktoken").read_bytes() == real_tiktoken_file.read_bytes()
