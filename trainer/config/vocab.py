"""How many ids the configured tokenizer has, and which tokenizer `tokenizer=auto` means, read with
the standard library alone (the checks run before torch and before the `tokenizers` library): the
OmegaConf resolvers behind model.vocab_size's default (the tokenizer's size) and conf/tokenizer/
auto.yaml (model.init_from's own tokenizer), and the tag of a non-GPT-2 tokenizer's datasets.
trainer/tokenizers/load.py loads the tokenizers themselves."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

# GPT-2's ids (trainer/tokenizers/gpt2.py's VOCAB_SIZE, kept here so that checking a config imports
# no tokenizer; a test keeps them equal)
TOKENIZER_VOCAB_SIZE = 50257
TOKENIZERS = ("gpt2", "hf")  # the `tokenizer` group (trainer/tokenizers/load.py); auto resolves to one
VOCAB_RESOLVER = "dtrain_tokenizer_vocab"
# A published checkpoint's marker and folder prefix (trainer/checkpoint/layout.py's MARKER and
# STEP_PREFIX, kept here so that config imports nothing above it; a test keeps them equal)
CHECKPOINT_MARKER = "COMPLETE"
CHECKPOINT_PREFIX = "step_"
SOURCE_TOKENIZER_RESOLVER = "dtrain_source_tokenizer"  # conf/tokenizer/auto.yaml


@functools.lru_cache(maxsize=8)
def _file_facts(file: str, _mtime_ns: int) -> tuple[int | None, bool, str]:  # the mtime keys the cache
    """(ids, whether it is GPT-2's BPE, the first 8 hex digits of its sha256) of a tokenizer.json,
    read and parsed once per file version: the resolvers below run on every access of the keys."""
    raw = Path(file).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:8]
    try:
        spec = json.loads(raw)
        vocab = spec.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) + [t["id"] for t in spec.get("added_tokens", [])]
        # GPT-2's own tokenizer.json (a GPT-2 folder) is the same BPE as tiktoken's
        is_gpt2 = len(vocab) == TOKENIZER_VOCAB_SIZE and vocab.get("<|endoftext|>") == TOKENIZER_VOCAB_SIZE - 1
        return max(ids) + 1, is_gpt2, digest
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, False, digest


def tokenizer_folder(path: str | None, checkpoint: str | None = None) -> str | None:
    """The folder a `tokenizer` config's files are read from: tokenizer.checkpoint's copy when it is
    set (trainer/checkpoint/tokenizer_copy.py; a continuation whose tokenizer.path no longer holds
    its run's tokenizer reads it there: trainer/preflight/run_tokenizer.py), else tokenizer.path.
    A checkpoint that retention removed since gives way to the newest complete one beside it that
    holds a copy: a run's checkpoints all hold its one tokenizer."""
    if not checkpoint:
        return path
    ckpt = Path(str(checkpoint)).expanduser()
    if (ckpt / "tokenizer.json").is_file():
        return str(ckpt)
    beside = [p for p in ckpt.parent.glob(f"{CHECKPOINT_PREFIX}*")
              if p.name[len(CHECKPOINT_PREFIX):].isdigit() and (p / CHECKPOINT_MARKER).is_file()
              and (p / "tokenizer.json").is_file()]
    newest = max(beside, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]), default=ckpt)
    return str(newest)


def _facts(folder) -> tuple[int | None, bool, str] | None:
    """_file_facts of folder/tokenizer.json, or None when it cannot be read."""
    file = Path(str(folder)).expanduser() / "tokenizer.json"
    try:
        return _file_facts(str(file.absolute()), file.stat().st_mtime_ns)
    except OSError:
        return None


def tokenizer_vocab_size(name: str, path: str | None, checkpoint: str | None = None) -> int:
    """How many ids the `tokenizer` config's tokenizer has, read from its tokenizer.json (stdlib
    only: the checks run before torch and before the `tokenizers` library). GPT-2's when it cannot
    be read: the tokenizer's own check (trainer/tokenizers/load.py) then names what is wrong."""
    folder = tokenizer_folder(path, checkpoint)
    facts = _facts(folder) if name == "hf" and folder else None
    return facts[0] if facts and facts[0] is not None else TOKENIZER_VOCAB_SIZE


def tokenizer_tag(tok) -> str | None:
    """A short tag of a non-GPT-2 tokenizer's file (the first 8 hex digits of its sha256, as its
    fingerprint begins), for the folder its datasets are prepared in; None for GPT-2's or when the
    file cannot be read (the tokenizer's own check then says why)."""
    folder = tokenizer_folder(tok.get("path"), tok.get("checkpoint")) if tok is not None else None
    if tok is None or tok.get("name") != "hf" or not folder:
        return None
    facts = _facts(folder)
    return facts[2] if facts else None


def source_tokenizer(init_from: str | None, field: str) -> str | None:
    """tokenizer=auto (the default): the tokenizer of model.init_from's Hugging Face folder when it
    holds a tokenizer.json other than GPT-2's (SmolLM2, Llama 3, Qwen3 ...), so fine-tuning a real
    checkpoint needs no extra key; else GPT-2's (a GPT-2 folder's keeps tiktoken's, and its datasets).
    `field`: "name" or "path"."""
    facts = _facts(init_from) if init_from else None  # a recipe's REQUIRED: no folder, no facts
    if facts is None or facts[1]:
        return "gpt2" if field == "name" else None
    return "hf" if field == "name" else str(Path(str(init_from)).expanduser().absolute())


OmegaConf.register_new_resolver(VOCAB_RESOLVER, tokenizer_vocab_size, replace=True)
OmegaConf.register_new_resolver(SOURCE_TOKENIZER_RESOLVER, source_tokenizer, replace=True)
