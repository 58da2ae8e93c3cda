"""The GPT-2 tokenizer (tiktoken), loadable offline.

Where the BPE ranks come from, in order:
  (a) a verified local copy ``<cache>/gpt2.tiktoken`` (cache = $DTRAIN_CACHE_DIR or ~/.cache/dtrain);
  (b) tiktoken's own ``get_encoding("gpt2")`` (downloads from openaipublic; skipped when
      DTRAIN_OFFLINE=1); on success the ranks are written to the cache so the next run is offline;
  (c) PyPI: the ``openai-whisper`` sdist ships the same file as ``whisper/assets/gpt2.tiktoken``;
      ``pip download`` it, extract that one member, verify its sha256, cache it, then use (a).
"""

from __future__ import annotations

import base64
import functools
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from trainer.errors import DataError
from trainer.fetch.downloads import PIP_TIMEOUT_S
from trainer.io import one_line, sha256_bytes, write_atomic

EOT = 50256  # <|endoftext|>, the document separator
VOCAB_SIZE = 50257
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_FINGERPRINT = GPT2_TIKTOKEN_SHA256[:16]  # what manifests and checkpoints record of it
WHISPER_SPEC = "openai-whisper==20250625"
WHISPER_SDIST = "openai_whisper-20250625.tar.gz"


def cache_dir() -> Path:
    return Path(os.environ.get("DTRAIN_CACHE_DIR") or "~/.cache/dtrain").expanduser()


def cached_ranks_path() -> Path:
    return cache_dir() / "gpt2.tiktoken"


def _offline() -> bool:
    return os.environ.get("DTRAIN_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _parse_ranks(data: bytes, origin: str) -> dict[bytes, int]:
    """The .tiktoken format: one ``base64(token) rank`` per line (as tiktoken.load parses it)."""
    ranks = {}
    for line in data.splitlines():
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except Exception as e:
            raise DataError(f"{origin} is not a valid .tiktoken file ({e}); delete it and retry") from e
    return ranks


def _dump_ranks(ranks: dict[bytes, int]) -> bytes:
    return b"".join(
        base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def _build(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


def _save_ranks(path: Path, data: bytes) -> None:
    """Cache a verified ranks file (readable by all: the cache may be shared by several users)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, durable=True, mode=0o644)


def load_ranks_file(path: Path) -> tiktoken.Encoding:
    """Build the encoding from a .tiktoken file, refusing it unless its sha256 is GPT-2's."""
    data = Path(path).read_bytes()
    digest = sha256_bytes(data)
    if digest != GPT2_TIKTOKEN_SHA256:
        raise DataError(
            f"{path} is not the GPT-2 tokenizer file (sha256 {digest[:12]}..., expected "
            f"{GPT2_TIKTOKEN_SHA256[:12]}...); delete it so dtrain can fetch a fresh copy"
        )
    return _build(_parse_ranks(data, str(path)))


def _from_tiktoken_online() -> tiktoken.Encoding:
    enc = tiktoken.get_encoding("gpt2")
    try:  # keep a verified copy so later runs work offline
        data = _dump_ranks(enc._mergeable_ranks)
        if sha256_bytes(data) == GPT2_TIKTOKEN_SHA256:
            _save_ranks(cached_ranks_path(), data)
    except Exception:
        pass
    return enc


def fetch_from_pypi(dest: Path | None = None, timeout: float = PIP_TIMEOUT_S) -> Path:
    """pip-download the openai-whisper sdist and extract its verified gpt2.tiktoken to ``dest``."""
    dest = Path(dest) if dest is not None else cached_ranks_path()
    with tempfile.TemporaryDirectory(prefix="dtrain-whisper-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            WHISPER_SPEC,
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"`pip download {WHISPER_SPEC}` failed: {e}") from e
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"`pip download {WHISPER_SPEC}` failed: {last}")
        sdist = Path(tmp) / WHISPER_SDIST
        if not sdist.exists():
            raise RuntimeError(f"`pip download {WHISPER_SPEC}` did not produce {WHISPER_SDIST}")
        with tarfile.open(sdist, "r:gz") as tar:
            member = next(
                (
                    m
                    for m in tar.getmembers()
                    if m.isfile() and m.name.endswith("/whisper/assets/gpt2.tiktoken")
                ),
                None,
            )
            if member is None:
                raise RuntimeError(f"{WHISPER_SDIST} has no whisper/assets/gpt2.tiktoken")
            data = tar.extractfile(member).read()
    digest = sha256_bytes(data)
    if digest != GPT2_TIKTOKEN_SHA256:
        raise RuntimeError(
            f"gpt2.tiktoken from {WHISPER_SDIST} has sha256 {digest}, expected {GPT2_TIKTOKEN_SHA256}"
        )
    _save_ranks(dest, data)
    return dest


@functools.lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding ("Hello world" -> [15496, 995]); cached per process."""
    path = cached_ranks_path()
    if path.exists():
        return load_ranks_file(path)  # a corrupt file raises DataError rather than being used
    errors = []
    if not _offline():
        try:
            return _from_tiktoken_online()
        except Exception as e:
            errors.append(f"tiktoken download: {type(e).__name__}")
    try:
        return load_ranks_file(fetch_from_pypi(path))
    except Exception as e:
        errors.append("PyPI: " + one_line(e))
    raise DataError(
        f"cannot load the GPT-2 tokenizer ({'; '.join(errors)}); allow access to PyPI, or copy "
        f"gpt2.tiktoken (sha256 {GPT2_TIKTOKEN_SHA256[:12]}..., from the openai-whisper package's "
        f"whisper/assets/) to {path}"
    )


@functools.lru_cache(maxsize=1)
def token_byte_lengths() -> tuple[int, ...]:
    """The UTF-8 bytes each token id stands for: bits per byte's denominator. <|endoftext|>, which
    stands for no text, counts 0 (15 ms for GPT-2's 50,257 ids, once per process)."""
    enc = gpt2_encoding()
    return tuple(0 if i == EOT else len(enc.decode_single_token_bytes(i)) for i in range(VOCAB_SIZE))


def encode(text: str) -> list[int]:
    """Token ids of ``text`` with special tokens treated as plain text."""
    return gpt2_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return gpt2_encoding().decode(list(ids))
