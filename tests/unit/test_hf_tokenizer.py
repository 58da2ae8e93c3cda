"""The GPT-2 tokenizer files `dtrain export` writes, derived from the cached tiktoken ranks, against
the published files (offline: the sha256s tiktoken records for OpenAI's encoder.json / vocab.bpe)."""

from __future__ import annotations

import inspect
import json

import tiktoken_ext.openai_public
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from trainer.io import sha256_bytes, sha256_file
from trainer.tokenizers import hf_files
from trainer.tokenizers.hf_files import (
    MERGES_TXT_SHA256,
    VOCAB_JSON_SHA256,
    gpt2_ranks,
    hf_tokenizer_files,
    write_hf_tokenizer,
)

# openai-whisper==20230124's sdist, whisper/assets/gpt2/special_tokens_map.json
WHISPER_SPECIAL_TOKENS_MAP_SHA256 = "c0b3c279b6ecdb71996a86ffb4d4ab94dfdb5df95f00bac9515688faef2ff5dd"


def test_vocab_and_merges_are_the_published_files_byte_for_byte():
    files = hf_tokenizer_files(1024)
    assert sha256_bytes(files["vocab.json"].encode()) == VOCAB_JSON_SHA256
    assert sha256_bytes(files["merges.txt"].encode()) == MERGES_TXT_SHA256
    # the constants are the ones tiktoken itself checks its downloads of GPT-2's files against
    source = inspect.getsource(tiktoken_ext.openai_public.gpt2)
    assert f'encoder_json_hash="{VOCAB_JSON_SHA256}"' in source
    assert f'vocab_bpe_hash="{MERGES_TXT_SHA256}"' in source
    assert sha256_bytes(files["special_tokens_map.json"].encode()) == WHISPER_SPECIAL_TOKENS_MAP_SHA256


def test_tiktoken_rebuilds_the_ranks_from_the_written_files(tmp_path, monkeypatch):
    """tiktoken's own reader of GPT-2's published format (which checks that vocab.json and the
    merges agree) turns the written files back into exactly the ranks they came from."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the files as they are, cache nothing
    write_hf_tokenizer(tmp_path, hf_tokenizer_files(1024))
    ranks = data_gym_to_mergeable_bpe_ranks(str(tmp_path / "merges.txt"), str(tmp_path / "vocab.json"),
                                            vocab_bpe_hash=MERGES_TXT_SHA256,
                                            encoder_json_hash=VOCAB_JSON_SHA256)
    assert ranks == gpt2_ranks()


def test_the_config_files(tmp_path):
    write_hf_tokenizer(tmp_path, hf_tokenizer_files(256), mode=0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "generation_config.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 256 and config["tokenizer_class"] == "GPT2Tokenizer"
    assert config["eos_token"] == config["bos_token"] == "<|endoftext|>"
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "_from_model_config": True, "bos_token_id": 50256, "eos_token_id": 50256}
    assert all((p.stat().st_mode & 0o777) == 0o640 for p in tmp_path.iterdir())
    assert sha256_file(tmp_path / "vocab.json") == VOCAB_JSON_SHA256
    assert not list(tmp_path.glob(".*.tmp"))  # written through write_atomic: no temporary left


def test_each_merge_joins_two_lower_ranked_tokens():
    ranks = gpt2_ranks()
    assert hf_files._merge_pair(b" the", ranks) == (b" t", b"he")
    for token, rank in ranks.items():
        if len(token) > 1:
            first, second = hf_files._merge_pair(token, ranks)
            assert first + second == token and ranks[first] < rank and ranks[second] < rank
    assert hf_files.merges_txt(ranks).splitlines()[:3] == ["#version: 0.2", "\u0120 t", "\u0120 a"]
