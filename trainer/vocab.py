"""How many ids the configured tokenizer has, and which tokenizer `tokenizer=auto` means, read with
the standard library alone (the checks run before torch and before the `tokenizers` library): the
OmegaConf resolvers behind model.vocab_size's default (the tokenizer's size) and conf/tokenizer/
auto.yaml (model.init_from's own tokenizer), and the tag of a non-GPT-2 tokenizer's datasets.
trainer/data/tokenizers.py loads the tokenizers themselves."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

# GPT-2's ids (trainer/data/tokenizer.py's VOCAB_SIZE, kept here so that checking a config imports
# no tokenizer; a test keeps them equal)
TOKENIZER_VOCAB_SIZE = 50257
TOKENIZERS = ("gpt2", "hf")  # the `tokenizer` group (trainer/data/tokenizers.py); auto resolves to one
VOCAB_RESOLVER = "dtrain_tokenizer_vocab"
SOURCE_TOKENIZER_RESOLVER = "dtrain_source_tokenizer"  # conf/tokenizer/auto.yaml


@functools.lru_cache(maxsize=8)
def _hf_vocab_size(file: str, _mtime_ns: int) -> int:  # the mtime keys the cache: an edit is read again
    spec = json.loads(Path(file).read_text(encoding="utf-8"))
    ids = list(spec.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in spec.get("added_tokens", [])]
    return max(ids) + 1


def tokenizer_vocab_size(name: str, path: str | None) -> int:
    """How many ids the `tokenizer` config's tokenizer has, read from its tokenizer.json (stdlib
    only: the checks run before torch and before the `tokenizers` library). GPT-2's when it cannot
    be read: the tokenizer's own check (trainer/data/tokenizers.py) then names what is wrong."""
    if name == "hf" and path:
        file = Path(str(path)).expanduser() / "tokenizer.json"
        try:
            return _hf_vocab_size(str(file.absolute()), file.stat().st_mtime_ns)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass
    return TOKENIZER_VOCAB_SIZE


def tokenizer_tag(tok) -> str | None:
    """A short tag of a non-GPT-2 tokenizer's file (the first 8 hex digits of its sha256, as its
    fingerprint begins), for the folder its datasets are prepared in; None for GPT-2's or when the
    file cannot be read (the tokenizer's own check then says why)."""
    if tok is None or tok.get("name") != "hf" or not tok.get("path"):
        return None
    try:
        return hashlib.sha256((Path(str(tok["path"])).expanduser() / "tokenizer.json").read_bytes()).hexdigest()[:8]
    except OSError:
        return None


def source_tokenizer(init_from: str | None, field: str) -> str | None:
    """tokenizer=auto (the default): the tokenizer of model.init_from's Hugging Face folder when it
    holds a tokenizer.json other than GPT-2's (SmolLM2, Llama 3, Qwen3 ...), so fine-tuning a real
    checkpoint needs no extra key; else GPT-2's. `field`: "name" or "path"."""
    folder = Path(str(init_from)).expanduser() if init_from else None  # a recipe's REQUIRED: no folder
    if folder is None or not (folder / "tokenizer.json").is_file():
        return "gpt2" if field == "name" else None
    try:  # GPT-2's own tokenizer.json (a GPT-2 folder) is the same BPE: keep tiktoken's, and its datasets
        vocab = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
        is_gpt2 = len(vocab) == TOKENIZER_VOCAB_SIZE and vocab.get("<|endoftext|>") == TOKENIZER_VOCAB_SIZE - 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        is_gpt2 = False
    if is_gpt2:
        return "gpt2" if field == "name" else None
    return "hf" if field == "name" else str(folder.absolute())


OmegaConf.register_new_resolver(VOCAB_RESOLVER, tokenizer_vocab_size, replace=True)
OmegaConf.register_new_resolver(SOURCE_TOKENIZER_RESOLVER, source_tokenizer, replace=True)
