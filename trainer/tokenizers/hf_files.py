"""The GPT-2 tokenizer as Hugging Face's files, derived offline from the cached tiktoken ranks.

`dtrain export` writes these next to the weights so that `AutoTokenizer.from_pretrained(folder)`,
`transformers.pipeline("text-generation", model=folder)` and lm-evaluation-harness's `hf` model work
on the folder with no download:

    vocab.json, merges.txt        byte for byte OpenAI's encoder.json and vocab.bpe (the files the
                                  Hugging Face `gpt2` repository ships; the tests check them
                                  against the sha256s tiktoken records for those)
    tokenizer_config.json,
    special_tokens_map.json       <|endoftext|> as bos, eos and unk, as the copy of gpt2's tokenizer
                                  in openai-whisper's sdists (20230124) has them
    generation_config.json        bos/eos 50256, as transformers writes it for GPT-2

The ranks hold the same information in another form: token bytes -> rank, where a token's rank is
also the priority of the merge that makes it. The merge for a token is recovered by running BPE on
its bytes with only the lower ranks: that stops at exactly two parts, the pair merged into it.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.io import write_atomic
from trainer.tokenizers.gpt2 import EOT, gpt2_encoding

EOT_TEXT = "<|endoftext|>"
# sha256 of OpenAI's published GPT-2 encoder.json and vocab.bpe (tiktoken_ext/openai_public.py
# records them); Hugging Face's gpt2 vocab.json and merges.txt are these same files. The tests
# check the derived files against them.
VOCAB_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_TXT_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte: printable Latin-1 bytes stand for themselves, the
    rest (control bytes, space, ...) take the code points 256, 257, ... in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _as_text(token: bytes, byte_chars: dict[int, str]) -> str:
    return "".join(byte_chars[b] for b in token)


def _merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins into `token`: merge the lowest-ranked adjacent pair, using only ranks
    below the token's own, until two parts are left."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = None, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best is None:
            raise ValueError(f"token {token!r} (rank {limit}) cannot be built from lower ranks")
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


def gpt2_ranks() -> dict[bytes, int]:
    """The cached GPT-2 ranks (trainer.tokenizers.gpt2 fetches and verifies them)."""
    return gpt2_encoding()._mergeable_ranks


def vocab_json(ranks: dict[bytes, int]) -> str:
    """vocab.json: token text -> id in id order, <|endoftext|> last, written as OpenAI's
    encoder.json (json.dumps' defaults: ASCII escapes, ", " and ": " separators)."""
    byte_chars = bytes_to_unicode()
    vocab = {_as_text(tok, byte_chars): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    vocab[EOT_TEXT] = EOT
    return json.dumps(vocab)


def merges_txt(ranks: dict[bytes, int]) -> str:
    """merges.txt: a version line, then one `first second` pair per line in rank order."""
    byte_chars = bytes_to_unicode()
    lines = ["#version: 0.2"]
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            first, second = _merge_pair(tok, ranks)
            lines.append(f"{_as_text(first, byte_chars)} {_as_text(second, byte_chars)}")
    return "\n".join(lines) + "\n"


def tokenizer_config_json(model_max_length: int) -> str:
    """tokenizer_config.json as openai-whisper's copy of gpt2 has it, with the exported model's
    context length and without the name of the repository it came from."""
    return json.dumps({"unk_token": EOT_TEXT, "bos_token": EOT_TEXT, "eos_token": EOT_TEXT,
                       "add_prefix_space": False, "model_max_length": model_max_length,
                       "tokenizer_class": "GPT2Tokenizer"})


def special_tokens_map_json() -> str:
    """special_tokens_map.json, byte for byte openai-whisper's copy of gpt2's."""
    return json.dumps({"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT})


def generation_config_json() -> str:
    """generation_config.json as transformers derives it from a GPT-2 config (the gpt2 repository's,
    less the version of transformers that wrote it)."""
    return json.dumps({"_from_model_config": True, "bos_token_id": EOT, "eos_token_id": EOT}, indent=2) + "\n"


def hf_tokenizer_files(model_max_length: int) -> dict[str, str]:
    """File name -> content of the tokenizer and generation files of an exported GPT-2 folder
    (loading the GPT-2 ranks: a DataError when they cannot be had)."""
    ranks = gpt2_ranks()
    return {
        "vocab.json": vocab_json(ranks),
        "merges.txt": merges_txt(ranks),
        "tokenizer_config.json": tokenizer_config_json(model_max_length),
        "special_tokens_map.json": special_tokens_map_json(),
        "generation_config.json": generation_config_json(),
    }


def write_hf_tokenizer(out_dir: Path, files: dict[str, str], mode: int = 0o644) -> None:
    """Write `files` (from hf_tokenizer_files) into out_dir, each one atomically."""
    for name, text in files.items():
        write_atomic(Path(out_dir) / name, text, mode=mode)
