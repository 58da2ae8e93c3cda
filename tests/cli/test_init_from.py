"""model.init_from: a new run from a Hugging Face GPT-2 folder, a dtrain run directory or a step_*
folder (trainer/weights/init_source.py checks it, trainer/weights/init_from.py loads it,
trainer/huggingface/mapping.py maps names)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import VOCAB, loaded_model, make_hf_folder
from helpers.dtrain import dtrain_env, read_metrics, run_dtrain, tiny_args

from trainer.checkpoint.layout import latest_checkpoint
from trainer.commands.export import export
from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.errors import ConfigError, UserError
from trainer.huggingface.mapping import CONV1D_WEIGHTS
from trainer.weights.from_checkpoint import model_from_run
from trainer.weights.init_source import check_init_source


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its sources are GPT-2-vocabulary models
    and Hugging Face GPT-2 folders."""
    return gpt2_data_dir


@pytest.fixture(scope="module")
def hf_folder(module_tmp) -> Path:
    return make_hf_folder(module_tmp.mktemp("hf") / "gpt2")


@pytest.mark.parametrize("pad", [1, 64])
def test_hf_weights_give_transformers_logits(hf_folder, pad):
    transformers = pytest.importorskip("transformers")
    model = loaded_model(hf_folder, f"model.pad_vocab_multiple={pad}")
    reference = transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(x)[0], reference(x).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-5
    if pad > 1:  # padded rows: the mean of the real rows (their logit is the mean logit)
        wte = model.transformer.wte.weight
        assert wte.shape[0] == 50304
        assert torch.allclose(wte[VOCAB:], wte[:VOCAB].double().mean(0).float().expand(50304 - VOCAB, -1))


def test_hub_layout_without_prefix_and_with_mask_buffers(hf_folder, tmp_path):
    """The Hub's original gpt2 files: GPT2Model names (no `transformer.`) and `attn.bias` buffers."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    transformers = pytest.importorskip("transformers")
    state = safetensors_torch.load_file(str(hf_folder / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
    (tmp_path / "hub").mkdir()
    safetensors_torch.save_file(hub, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "hub" / "config.json").write_text((hf_folder / "config.json").read_text())
    model = loaded_model(tmp_path / "hub")
    reference = transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    x = torch.randint(0, VOCAB, (1, 64))
    with torch.no_grad():
        assert (model(x)[0] - reference(x).logits).abs().max().item() < 1e-5


def step0_checkpoint(args: list[str]) -> subprocess.CompletedProcess:
    """A one-step run whose step is poisoned and skipped (train.on_nonfinite=skip, the product's own
    fault hook): no update is made, so its checkpoint holds exactly the weights the ranks loaded."""
    env = {**dtrain_env(), "DTRAIN_INJECT_NONFINITE": "1"}
    return run_dtrain([*args, "train.max_steps=1", "train.on_nonfinite=skip"], env=env)


@pytest.mark.slow
def test_fsdp_world2_starts_from_the_hf_weights(hf_folder, data_dir, tmp_path):
    """A real `dtrain train parallel=fsdp world=2` (each rank reads only its shards): the step-0
    weights equal the HF file's bitwise and give transformers' logits."""
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    proc = step0_checkpoint(tiny_args(data_dir, run_dir, "parallel=fsdp", "world=2", f"model.init_from={hf_folder}"))
    assert proc.returncode == 0, proc.stderr
    assert f"model.init_from={hf_folder}: weights from {hf_folder}" in proc.stderr
    model, _ = model_from_run(run_dir)
    reference = transformers.GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    for name, tensor in reference.state_dict().items():
        if name.endswith((".attn.bias", ".masked_bias")):
            continue
        ours = model.state_dict()[name]
        assert torch.equal(ours.t() if name.endswith(CONV1D_WEIGHTS) else ours, tensor), name
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(x)[0] - reference(x).logits).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def source_run(data_dir, module_tmp) -> Path:
    """A tiny run (vocabulary padded to 50304) trained 20 steps: the source of the dtrain cases."""
    run_dir = module_tmp.mktemp("source") / "run"
    run_dtrain(tiny_args(data_dir, run_dir, "model.pad_vocab_multiple=64", "train.val_tokens=1024"), check=True)
    return run_dir


@pytest.mark.parametrize("kind", ["run_dir", "step_folder", "export"])
@pytest.mark.parametrize("pad", [64, 1])
def test_dtrain_sources_load_bitwise(source_run, tmp_path, kind, pad):
    """A run dir (its newest checkpoint), one step_* folder, or its export: the weights at step 0 are
    the checkpoint's exactly (real vocabulary rows; padded rows are re-made where the padding differs)."""
    if kind == "export":
        pytest.importorskip("safetensors")
        spec, _ = export(source_run, tmp_path / "export")
    else:
        spec = source_run if kind == "run_dir" else latest_checkpoint(source_run)
    trained, _ = model_from_run(source_run)
    model = loaded_model(spec, f"model.pad_vocab_multiple={pad}")
    ours, theirs = model.state_dict(), trained.state_dict()
    for name, tensor in theirs.items():
        if name in ("transformer.wte.weight", "lm_head.weight"):
            assert torch.equal(ours[name][:VOCAB], tensor[:VOCAB]), name
            if pad == 64 and kind != "export":  # same padding, same tensor: the padded rows too
                assert torch.equal(ours[name], tensor)
        else:
            assert torch.equal(ours[name], tensor), name
    assert ours["transformer.wte.weight"].shape[0] == (50304 if pad == 64 else VOCAB)


def test_padding_back_from_an_unpadded_run(source_run, data_dir, tmp_path):
    """pad 64 -> 1 (a run's step-0 checkpoint) -> 64: the real rows survive both ways, bitwise."""
    unpadded = tmp_path / "unpadded"
    proc = step0_checkpoint(tiny_args(data_dir, unpadded, f"model.init_from={source_run}"))
    assert proc.returncode == 0, proc.stderr
    middle, _ = model_from_run(unpadded)
    assert middle.transformer.wte.weight.shape[0] == VOCAB
    back = loaded_model(unpadded, "model.pad_vocab_multiple=64")
    trained, _ = model_from_run(source_run)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(back.state_dict()[name][:VOCAB], tensor[:VOCAB]), name


@pytest.mark.slow
def test_finetune_lowers_the_val_loss(source_run, data_dir, tmp_path):
    run_dir = tmp_path / "finetune"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "model.pad_vocab_multiple=64", "train.val_tokens=1024",
                                "optim.lr=1e-3", "optim.warmup_steps=2", f"model.init_from={source_run}"))
    assert proc.returncode == 0, proc.stderr
    source_val = [r["val_loss"] for r in read_metrics(source_run) if "val_loss" in r][-1]
    records = read_metrics(run_dir)
    first_loss = next(r["loss"] for r in records if "loss" in r)
    final_val = [r["val_loss"] for r in records if "val_loss" in r][-1]
    # the same first batch as the source's first step: the trained weights already do better on it
    assert first_loss < next(r["loss"] for r in read_metrics(source_run) if "loss" in r) - 0.3
    assert final_val < source_val - 0.05


def test_shape_mismatch_is_one_line_and_writes_nothing(hf_folder, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "model=cpu_small", f"model.init_from={hf_folder}"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.init_from=")
    assert "n_layer=2 n_head=2 n_embd=64 n_positions=128" in lines[0]
    assert "model=cpu_small has n_layer=" in lines[0] and "choose model=tiny" in lines[0]
    assert not run_dir.exists()


def test_source_checks(hf_folder, tmp_path):
    tiny = compose(["model=tiny", "model.bias=false"]).model
    with pytest.raises(ConfigError, match="non-zero biases .* set model.bias=true"):
        check_init_source(str(hf_folder), tiny)
    zero = make_hf_folder(tmp_path / "zero", zero_biases=True)
    assert check_init_source(str(zero), tiny).kind == "hf"  # zeros are the same function
    with pytest.raises(UserError, match="does not exist"):
        check_init_source(str(tmp_path / "nowhere"), tiny)
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="pickle, which dtrain never loads"):
        check_init_source(str(tmp_path / "pickle"), tiny)
    longer = compose(["model=tiny", f"model.init_from={hf_folder}", "train.seq_len=256"])
    with pytest.raises(ConfigError, match="train.seq_len=256 is longer than model.block_size=128; the positions"):
        validate(longer)
    # the recipe without a source, through the command: one line, nothing written
    recipe = run_dtrain(["train", "experiment=finetune_shakespeare", f"hydra.run.dir={tmp_path / 'ft'}"])
    assert recipe.returncode == 2 and recipe.stderr.strip().count("\n") == 0, recipe.stderr
    assert "pass model.init_from=PATH" in recipe.stderr and not (tmp_path / "ft").exists()


def test_a_truncated_or_malformed_safetensors_source_is_one_line_and_writes_nothing(hf_folder, data_dir, tmp_path):
    """A partial download or copy of model.safetensors (cut in its data or in its header), or a
    header whose offsets do not fit, is refused from the header and the file's size, before anything
    is written: not a traceback from the safetensors reader in a worker."""
    source = tmp_path / "cut"
    shutil.copytree(hf_folder, source)
    weights = source / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:100_000])
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, f"model.init_from={source}"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: model.init_from={source}: {weights} is truncated"), lines
    assert f"holds 100,000 bytes, its header promises {len(whole):,}" in lines[0] and "again" in lines[0]
    assert not run_dir.exists()
    tiny = compose(["model=tiny"]).model
    (length,) = struct.unpack("<Q", whole[:8])
    header = json.loads(whole[8:8 + length])
    name = next(k for k in header if k != "__metadata__")

    def with_header(edit) -> bytes:
        changed = json.loads(whole[8:8 + length])
        edit(changed[name])
        text = json.dumps(changed).encode()
        return struct.pack("<Q", len(text)) + text + whole[8 + length:]

    begin, end = header[name]["data_offsets"]
    broken = {
        "cut in the header": (whole[:8 + length // 2], "truncated"),
        "cut in the length": (whole[:5], "not a readable safetensors file"),
        "longer than promised": (whole + b"\0" * 8, "longer than its header says"),
        "offsets of another size": (with_header(lambda e: e.update(data_offsets=[begin, end + 4])), "data_offsets"),
        "an unknown dtype": (with_header(lambda e: e.update(dtype="F33")), "dtype 'F33'"),
        "a shape of strings": (with_header(lambda e: e.update(shape=["64"])), "shape and data_offsets"),
    }
    for case, (data, needle) in broken.items():
        weights.write_bytes(data)
        with pytest.raises(UserError) as err:
            check_init_source(str(source), tiny)
        assert needle in str(err.value) and "\n" not in str(err.value), case
    weights.write_bytes(whole)
    assert check_init_source(str(source), tiny).kind == "hf"


@pytest.mark.slow
def test_resume_wins_and_a_changed_source_is_another_run(hf_folder, data_dir, tmp_path):
    """A crashed run (stopped at step 2, checkpoint at 1) continues from its own checkpoint, saying
    init_from is ignored; the same run dir with another init_from is another run's: one line."""
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=3", "checkpoint.interval=1", f"model.init_from={hf_folder}")
    crashed = run_dtrain(args, env={**dtrain_env(), "DTRAIN_INJECT_NONFINITE": "2"})
    assert crashed.returncode == 1 and latest_checkpoint(run_dir).name == "step_000001"
    # the same command from the source's parent folder, naming it relatively: the same run
    relative = [a for a in args if not a.startswith("model.init_from")] + [f"model.init_from={hf_folder.name}"]
    resumed = run_dtrain(relative, cwd=hf_folder.parent)
    assert resumed.returncode == 0, resumed.stderr
    assert f"model.init_from={hf_folder} ignored: this run continues from its own checkpoint" in resumed.stderr
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3]
    other = run_dtrain([a for a in args if not a.startswith("model.init_from")] + [f"model.init_from={tmp_path}"])
    assert other.returncode == 2 and "model.init_from=" in other.stderr and "another run's outputs" in other.stderr
