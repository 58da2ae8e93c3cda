"""Any tokenizer (issue 36 items 1-4): the `tokenizer` group (gpt2, hf tokenizer.path=DIR, auto from
model.init_from), `dtrain tokenizer train`, uint16 or uint32 shards by vocabulary, the tokenizer in
the data's and the run's identity, and the run's tokenizer in sample and export. A Qwen3-style
folder made by transformers with its own 70,000+ token tokenizer goes prepare -> init_from ->
train -> export -> transformers' greedy text equal to `dtrain sample`'s, never touching GPT-2's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dtrain import TINYSHAKESPEARE, corpus_text, dtrain_env, read_metrics, run_dtrain
from helpers.errors import assert_user_error
from helpers.tokenizers import byte_level_folder

from trainer.config.compose import compose
from trainer.data.layout import dataset_dir
from trainer.tokenizers.load import load_tokenizer

tokenizers = pytest.importorskip("tokenizers")
BIG_VOCAB = 70_001  # over 65,536: uint32 shards


def big_vocab_folder(folder: Path) -> Path:
    """A byte-level tokenizer padded with unused tokens to 70,001 ids, its end-of-text the last one:
    every document separator in its data is an id above 65,535."""
    pre_tokenizers = tokenizers.pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), BIG_VOCAB - 1)})
    vocab["<|endoftext|>"] = BIG_VOCAB - 1
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_byte_level_tokenizers_byte_lengths_add_up(tmp_path):
    folder = byte_level_folder(tmp_path / "tok", [corpus_text()], 600)
    tok = load_tokenizer({"name": "hf", "path": str(folder)})
    text = "Hello, wörld: naïve café ✓ — 東京\n\tend"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert sum(tok.byte_lengths()[i] for i in ids) == len(text.encode("utf-8"))
    assert tok.byte_lengths()[tok.eot] == 0 and tok.vocab_size == 600
    # a special token's text inside a document is text, not the separator
    assert tok.eot not in tok.encode("a <|endoftext|> b") and tok.encode_prompt("<|endoftext|>") == [tok.eot]


def test_model_vocab_follows_the_tokenizer_and_a_smaller_model_is_refused(tmp_path):
    folder = byte_level_folder(tmp_path / "tok", [corpus_text()], 700)
    cfg = compose(["tokenizer=hf", f"tokenizer.path={folder}"])
    assert cfg.model.vocab_size == 700 and compose([]).model.vocab_size == 50257
    proc = run_dtrain(["plan", "tokenizer=hf", f"tokenizer.path={folder}", "model.vocab_size=600"])
    assert_user_error(proc, f"model.vocab_size=600 is smaller than tokenizer.path={folder}'s 700 tokens")
    assert_user_error(run_dtrain(["plan", "tokenizer=hf"]), "tokenizer=hf needs tokenizer.path=DIR")


@pytest.mark.slow
def test_tokenizer_train_is_deterministic_and_says_its_figures(tmp_path):
    source = TINYSHAKESPEARE if TINYSHAKESPEARE.exists() else tmp_path / "corpus.txt"
    if not source.exists():  # a checkout without the shared corpus: the generated text
        source.write_text(corpus_text())
    args = ["tokenizer", "train", "data=text", "data.name=shakes", f"data.source={source}",
            f"data.dir={tmp_path / 'data'}", "tokenizer.vocab_size=1024"]
    first = run_dtrain([*args, f"tokenizer.path={tmp_path / 'a'}"], check=True)
    run_dtrain([*args, f"tokenizer.path={tmp_path / 'b'}"], check=True)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert "byte-level BPE of 1,024 tokens" in first.stdout and "bytes per token" in first.stdout
    tok = load_tokenizer({"name": "hf", "path": str(tmp_path / "a")})
    assert tok.vocab_size == 1024 and tok.decode(tok.encode("ROMEO: o, Juliet")) == "ROMEO: o, Juliet"
    assert_user_error(run_dtrain([*args[:-1], f"tokenizer.path={tmp_path / 'c'}"]),
                      "tokenizer.vocab_size=None: give the size to train")
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_big_vocabulary_data_is_uint32_and_beside_gpt2s(tmp_path):
    folder = big_vocab_folder(tmp_path / "big")
    source = tmp_path / "corpus.txt"
    source.write_text("First doc.\n\nSecond one, longer.\n" * 50)
    data = ["data=text", "data.name=c", f"data.source={source}", f"data.dir={tmp_path / 'data'}"]
    run_dtrain(["prepare", *data], check=True)  # GPT-2's
    run_dtrain(["prepare", *data, "tokenizer=hf", f"tokenizer.path={folder}"], check=True)
    gpt2_dir, (hf_dir,) = tmp_path / "data" / "c", list((tmp_path / "data").glob("c.tok-*"))
    gpt2_m, hf_m = (json.loads((d / "manifest.json").read_text()) for d in (gpt2_dir, hf_dir))
    assert (gpt2_m["dtype"], gpt2_m["tokenizer"], gpt2_m["vocab_size"]) == ("uint16", "gpt2", 50257)
    assert (hf_m["dtype"], hf_m["tokenizer"], hf_m["vocab_size"], hf_m["eot"]) == ("uint32", "hf", BIG_VOCAB,
                                                                                  BIG_VOCAB - 1)
    ids = np.fromfile(hf_dir / hf_m["splits"]["train"][0]["file"], dtype="<u4")
    assert ids[0] == BIG_VOCAB - 1 and ids.max() == BIG_VOCAB - 1 and ids[1:].max() < 256


@pytest.mark.slow
def test_data_of_another_tokenizer_is_one_line(tmp_path):
    """A dataset whose manifest records tokenizer A, read by a run of tokenizer B (a hand-copied
    folder): one error line naming both, nothing written."""
    a = byte_level_folder(tmp_path / "a", [corpus_text()], 500)
    b = byte_level_folder(tmp_path / "b", [corpus_text()], 520)
    source = tmp_path / "corpus.txt"
    source.write_text(corpus_text()[:20000])
    data = ["data=text", "data.name=c", f"data.source={source}", f"data.dir={tmp_path / 'data'}"]
    run_dtrain(["prepare", *data, "tokenizer=hf", f"tokenizer.path={a}"], check=True)
    (made,) = (tmp_path / "data").glob("c.tok-*")
    cfg = compose([*data, "tokenizer=hf", f"tokenizer.path={b}"])
    made.rename(dataset_dir(cfg.data))  # B's folder now holds A's ids
    run_dir = tmp_path / "run"
    proc = run_dtrain(["train", *data, "tokenizer=hf", f"tokenizer.path={b}", "model=tiny", "train.max_steps=1",
                       f"hydra.run.dir={run_dir}"])
    assert_user_error(proc, "records tokenizer 'hf' with 500 ids")
    assert "this run's tokenizer is tokenizer 'hf' with 520 ids" in proc.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_qwen3_folder_with_its_own_big_tokenizer_end_to_end(tmp_path):
    """init_from a transformers Qwen3 folder holding a 70,001-id tokenizer: the default tokenizer is
    the folder's (tokenizer=auto), prepare writes uint32, training starts from its weights, and the
    export's greedy generation in transformers equals `dtrain sample`'s. GPT-2's ranks are never
    read: the cache is an empty folder and downloads are off."""
    transformers = pytest.importorskip("transformers")
    folder = big_vocab_folder(tmp_path / "qwen")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=BIG_VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                      eos_token_id=BIG_VOCAB - 1, bos_token_id=BIG_VOCAB - 1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    env = {**dtrain_env(), "DTRAIN_CACHE_DIR": str(tmp_path / "empty-cache"),
           "DTRAIN_OFFLINE": "1"}
    source = tmp_path / "corpus.txt"
    source.write_text(corpus_text()[:40000])
    run_dir = tmp_path / "run"
    common = ["data=text", "data.name=c", f"data.source={source}", f"data.dir={tmp_path / 'data'}",
              "model=llama_tiny", "model.qk_norm=true", f"model.init_from={folder}"]
    run_dtrain(["prepare", *common], env=env, check=True)
    (prepared,) = (tmp_path / "data").glob("c.tok-*")
    assert json.loads((prepared / "manifest.json").read_text())["dtype"] == "uint32"
    run_dtrain(["train", *common, "train.max_steps=3", "train.micro_batch_size=2", "train.seq_len=64",
                "train.val_tokens=128", "train.sample_tokens=0", f"hydra.run.dir={run_dir}"], env=env, check=True)
    assert read_metrics(run_dir)[-1]["summary"]["steps"] == 3
    exported = run_dtrain(["export", str(run_dir), f"out={tmp_path / 'hf'}"], env=env, check=True).stdout
    # issue 45, finding 18: the line said "the GPT-2 tokenizer" whatever the run's was
    assert "the run's tokenizer (70,001 ids): tokenizer.json" in exported and "GPT-2" not in exported, exported
    sample = run_dtrain(["sample", str(run_dir), "prompt=Hello there", "tokens=8", "temperature=0", "device=cpu"],
                        env=env, check=True).stdout.rstrip("\n")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tok("Hello there", return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=BIG_VOCAB - 1)
    assert tok.decode(out[0]) == sample
    assert not (tmp_path / "empty-cache" / "gpt2.tiktoken").exists()
