"""Hugging Face Llama both ways: `dtrain export` of a Llama-shaped model is a LlamaForCausalLM (with
QK-norm a Qwen3ForCausalLM) whose logits are ours, and `model.init_from` reads the folders
transformers writes (sharded, or LlamaModel's names without `model.` too) into the matching group.
The mapping is trainer/huggingface/llama.py; GPT-2's cases are tests/unit/test_export.py and
tests/cli/test_init_from.py."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import loaded_model, make_hf_folder, perturbed
from helpers.dtrain import dtrain_env, read_metrics, run_dtrain, tiny_args

from trainer.config.compose import compose
from trainer.errors import CheckpointError, ConfigError
from trainer.huggingface.llama import llama_parts
from trainer.huggingface.mapping import hf_config, read_llama_region, to_hf_state_dict
from trainer.model.gpt import build_model
from trainer.weights.from_checkpoint import model_from_run
from trainer.weights.init_source import check_init_source

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 50257
# llama_tiny's shape as transformers spells it: GQA (4 q / 2 kv heads), SwiGLU 192, untied head
HF_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", []),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", ["model.qk_norm=true"])}


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its Hugging Face Llama folders have a
    GPT-2-sized vocabulary."""
    return gpt2_data_dir


def llama_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """tiny_args with model=llama_tiny (a later model=... in `extra` still wins)."""
    args = tiny_args(data_dir, run_dir, *extra)
    args[args.index("model=tiny")] = "model=llama_tiny"
    return args


def hf_llama_folder(folder: Path, family: str = "llama", **overrides) -> Path:
    """A transformers model of llama_tiny's shape with random weights, saved by save_pretrained."""
    config_class, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**HF_SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    perturbed(model).save_pretrained(folder)
    return folder


def max_diff(ours, reference, x) -> float:
    with torch.no_grad():
        return (ours(x)[0][..., :VOCAB] - reference(x).logits).abs().max().item()


@pytest.mark.parametrize("overrides", [[], ["model.qk_norm=true"], ["model.bias=true"], ["model.n_kv_head=4"],
                                       ["model.tie_embeddings=true", "model.pad_vocab_multiple=64"],
                                       ["model.rope_theta=500000"]],  # not the default: config.json must carry it
                         ids=["gqa_untied", "qwen3", "bias", "mha", "tied_pad64", "rope_theta"])
def test_the_mapping_gives_transformers_logits(overrides, tmp_path):
    model = perturbed(build_model(compose(["model=llama_tiny", *overrides]).model))
    safetensors_torch.save_file(to_hf_state_dict(model), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model)))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reference).__name__ == ("Qwen3ForCausalLM" if "model.qk_norm=true" in overrides else "LlamaForCausalLM")
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(2))
    assert max_diff(model, reference, x) < 1e-5


@pytest.fixture(scope="module")
def llama_run(data_dir, module_tmp) -> Path:
    """llama_tiny trained 12 steps (vocabulary padded to 50304), its val loss recorded at the end."""
    run_dir = module_tmp.mktemp("llama") / "run"
    run_dtrain(llama_args(data_dir, run_dir, "train.max_steps=12", "model.pad_vocab_multiple=64",
                          "train.val_tokens=1024", "optim.lr=3e-3"), check=True)
    return run_dir


@pytest.fixture(scope="module")
def exported(llama_run, module_tmp) -> Path:
    out = module_tmp.mktemp("export") / "hf"
    proc = run_dtrain(["export", str(llama_run), "--out", str(out)], check=True)
    assert "a Hugging Face model folder" in proc.stdout
    return out


@pytest.mark.slow
def test_export_is_a_llama_transformers_loads(llama_run, exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    shape = (config["num_key_value_heads"], config["intermediate_size"], config["tie_word_embeddings"])
    assert shape == (2, 192, False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(reference).__name__ == "LlamaForCausalLM"
    assert reference.model.embed_tokens.weight.shape[0] == VOCAB  # the padding rows dropped
    model, _ = model_from_run(llama_run)
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(3))
    assert max_diff(model.eval(), reference, x) < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]


def first_val_loss_from(data_dir: Path, run_dir: Path, source: Path) -> float:
    """A one-step run from `source` whose step is poisoned and skipped (the product's fault hook):
    its end-of-run val loss is the loaded weights' own."""
    env = {**dtrain_env(), "DTRAIN_INJECT_NONFINITE": "1"}
    proc = run_dtrain(llama_args(data_dir, run_dir, "train.max_steps=1", "train.on_nonfinite=skip",
                                 "train.val_tokens=1024", f"model.init_from={source}"), env=env)
    assert proc.returncode == 0, proc.stderr
    return [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r][-1]


@pytest.mark.slow
def test_init_from_the_export_resaved_by_transformers_starts_at_the_source_val_loss(llama_run, exported, data_dir,
                                                                                       tmp_path):
    """The resaved folder starts exactly where dtrain's own export does, and that is the source's
    val loss less what the source's 47 padded vocabulary rows (trained, then dropped by the export)
    took of the softmax: about log(1 + 47 / 50257) while the logits are still near uniform. How
    close that comes to the bound depends on the corpus (tiny-shakespeare or the generated one)."""
    resaved = tmp_path / "resaved"
    transformers.AutoModelForCausalLM.from_pretrained(exported).save_pretrained(resaved)
    source_val = [r["val_loss"] for r in read_metrics(llama_run) if "val_loss" in r][-1]
    val = first_val_loss_from(data_dir, tmp_path / "run", resaved)
    assert abs(val - first_val_loss_from(data_dir, tmp_path / "direct", exported)) < 1e-6 * val
    padding_share = math.log1p((50304 - VOCAB) / VOCAB)
    assert -1e-5 < source_val - val < 2 * padding_share, (val, source_val, padding_share)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("pad", [1, 64])
def test_init_from_a_transformers_folder_gives_its_logits(family, pad, tmp_path):
    folder = hf_llama_folder(tmp_path / family, family)
    model = loaded_model(folder, f"model.pad_vocab_multiple={pad}", *FAMILIES[family][2], model="llama_tiny")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(4))
    assert max_diff(model, reference, x) < 1e-5
    if pad > 1:  # the untied head's padded rows: the mean real row (their logit is the mean logit)
        head = model.lm_head.weight
        assert torch.allclose(head[VOCAB:], head[:VOCAB].double().mean(0).float().expand(50304 - VOCAB, -1))


def test_a_qwen3_head_dim_apart_from_the_width_round_trips(tmp_path):
    """Qwen3's heads are wider than hidden / heads (0.6B: 16 x 128 on 1024): a transformers
    Qwen3ForCausalLM with 4 heads of 32 on a 64-wide stream loads into model.head_dim=32 with its
    logits, and the export is a Qwen3ForCausalLM with head_dim 32 and the same logits. Without
    model.head_dim the group does not describe the source: one error naming the key to set."""
    folder = hf_llama_folder(tmp_path / "qwen3", "qwen3", head_dim=32)
    with pytest.raises(ConfigError, match="set model.head_dim=32"):
        check_init_source(str(folder), compose(["model=llama_tiny", "model.qk_norm=true"]).model)
    model = loaded_model(folder, "model.qk_norm=true", "model.head_dim=32", model="llama_tiny")
    assert model.transformer.h[0].attn.c_attn.weight.shape == (4 * 32 + 2 * 2 * 32, 64)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(5))
    assert max_diff(model, reference, x) < 1e-5
    out = tmp_path / "export"
    out.mkdir()
    safetensors_torch.save_file(to_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model)))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM" and exported.config.head_dim == 32
    assert max_diff(model, exported, x) < 1e-5


def test_sharded_folder_and_llama_model_names(tmp_path):
    """The Hub's other layouts: shards listed by model.safetensors.index.json, and a LlamaModel save
    whose names lack `model.` (its head, untied, still `lm_head.weight`)."""
    folder = hf_llama_folder(tmp_path / "one")
    state = safetensors_torch.load_file(str(folder / "model.safetensors"))
    hub = tmp_path / "hub"
    hub.mkdir()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        part = {k.removeprefix("model."): state[k] for k in keys}
        safetensors_torch.save_file(part, str(hub / file), metadata={"format": "pt"})
    weight_map = {k.removeprefix("model."): file for file, keys in shards.items() for k in keys}
    (hub / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hub / "config.json").write_text((folder / "config.json").read_text())
    model = loaded_model(hub, model="llama_tiny")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_diff(model, reference, torch.randint(0, VOCAB, (1, 64))) < 1e-5


def test_a_shard_reads_only_its_rows_of_the_fused_parts(tmp_path):
    """Any row range of a fused q|k|v or gate|up matrix (an FSDP shard, which may cut a part) is
    the same rows of the stacked HF tensors."""
    folder = hf_llama_folder(tmp_path / "hf")
    full = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    shape = {**compose(["model=llama_tiny"]).model}
    parts = llama_parts(shape)
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        for name in ("transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"):
            stacked = torch.cat([full[key] for key, _ in parts[name]])
            n = stacked.shape[0]
            cuts = ((0, n, 0), (n // 3 - 1, n // 4 + 3, 3), (n // 2 + 3, n // 2 - 3, 10), (n - 7, 7, 0))
            for start, rows, col in cuts:
                got = read_llama_region(handle, name, parts[name], (start, col), (rows, 64 - col))
                assert torch.equal(got, stacked[start:start + rows, col:]), (name, start)


@pytest.mark.slow
def test_fsdp_world2_starts_from_the_llama_folder(data_dir, tmp_path):
    """A real `dtrain train parallel=fsdp world=2` from a LlamaForCausalLM folder, each rank reading
    only its shards: the step-0 weights give transformers' logits."""
    folder = hf_llama_folder(tmp_path / "hf")
    env = {**dtrain_env(), "DTRAIN_INJECT_NONFINITE": "1"}
    run_dir = tmp_path / "run"
    proc = run_dtrain(llama_args(data_dir, run_dir, "parallel=fsdp", "world=2", "train.max_steps=1",
                                 "train.on_nonfinite=skip", f"model.init_from={folder}"), env=env)
    assert proc.returncode == 0, proc.stderr
    model, _ = model_from_run(run_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_diff(model.eval(), reference, torch.randint(0, VOCAB, (2, 128))) < 1e-5


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_init_from_mismatches_are_one_line_and_write_nothing(llama_run, data_dir, tmp_path):
    folder = hf_llama_folder(tmp_path / "hf")
    cases = [
        (["model=tiny", f"model.init_from={folder}"], ["norm=rmsnorm", "choose model=llama_tiny"]),
        (["model.n_kv_head=4", f"model.init_from={folder}"], ["n_kv_head=2", "set model.n_kv_head=2"]),
        (["model=llama_tiny", f"model.init_from={make_hf_folder(tmp_path / 'gpt2')}"],
         ["model=llama_tiny has", "choose model=tiny"]),
        (["model.tie_embeddings=true", f"model.init_from={llama_run}"], ["set model.tie_embeddings=false"]),
    ]
    for overrides, needles in cases:
        run_dir = tmp_path / "run"
        line = one_line_error(run_dtrain(llama_args(data_dir, run_dir, *overrides)))
        assert all(n in line for n in needles), (line, needles)
        assert not run_dir.exists()


def test_unsupported_llama_variants_are_named(tmp_path):
    llama_tiny = compose(["model=llama_tiny"]).model
    for overrides, needle in ((dict(hidden_act="gelu"), "hidden_act=gelu"),
                              (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type=linear")):
        folder = tmp_path / needle
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **HF_SHAPE, **overrides}))
        with pytest.raises(CheckpointError, match=f"llama variant dtrain's model cannot reproduce .*{needle}"):
            check_init_source(str(folder), llama_tiny)
    folder = hf_llama_folder(tmp_path / "short")
    header_only = {k: v for k, v in safetensors_torch.load_file(str(folder / "model.safetensors")).items()
                   if "layers.1.mlp.up_proj" not in k}
    safetensors_torch.save_file(header_only, str(folder / "model.safetensors"))
    missing = "has no tensor 'model.layers.1.mlp.up_proj.weight'; it is not a complete llama"
    with pytest.raises(CheckpointError, match=missing):
        check_init_source(str(folder), llama_tiny)


@pytest.mark.parametrize("overrides, needle", [
    (["model.mlp=relu2"], "the nearest, Llama, lacks model.mlp=relu2 (Llama's is swiglu)"),
    (["model.qk_norm=true", "model.bias=true"], "Qwen3's (its QK-norm family) has no MLP biases"),
], ids=["relu2", "qk_norm_with_bias"])
@pytest.mark.slow
def test_export_of_a_block_no_hub_format_has_is_one_line(overrides, needle, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dtrain(llama_args(data_dir, run_dir, "train.max_steps=1", *overrides), check=True)
    out = tmp_path / "out"
    line = one_line_error(run_dtrain(["export", str(run_dir), "--out", str(out)]))
    assert needle in line and not out.exists()


def test_gpt2_export_without_a_gpt2_block_is_refused():
    model = build_model(compose(["model=tiny", "model.n_kv_head=1"]).model)
    with pytest.raises(ConfigError, match="the nearest, GPT-2, lacks model.n_kv_head=1"):
        to_hf_state_dict(model)
