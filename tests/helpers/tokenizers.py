"""Tokenizers made for a test by the `tokenizers` library (a test that needs one is skipped where
the package is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def byte_level_folder(folder: Path, texts: list[str], vocab_size: int, eos_config: bool = True) -> Path:
    """A GPT-2-style byte-level BPE trained on `texts` by the tokenizers library, saved as a model
    folder's tokenizer.json (and tokenizer_config.json naming its end-of-text token)."""
    tokenizers = pytest.importorskip("tokenizers")
    models, pre_tokenizers, decoders, trainers = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.decoders, \
        tokenizers.trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                  "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder
