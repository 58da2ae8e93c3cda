"""Hugging Face Qwen3-MoE both ways: `dtrain export` of a mixture-of-experts model is a
Qwen3MoeForCausalLM whose logits are ours, and `model.init_from` reads the folders transformers
writes, its experts one matrix each (the Hub's layout, save_pretrained's default) or stacked
(transformers 5's own, save_original_format=False). The mapping is
trainer/huggingface/qwen3_moe.py on top of llama.py; the dense families are tests/cli/test_hf_llama.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import loaded_model, perturbed
from helpers.dtrain import dtrain_env, run_dtrain, tiny_args
from helpers.errors import one_line_error

from trainer.config.compose import compose
from trainer.errors import CheckpointError, ConfigError
from trainer.huggingface.llama import export_family, llama_parts
from trainer.huggingface.mapping import SafetensorsFolder, hf_config, read_expert_region, to_hf_state_dict
from trainer.model.gpt import build_model
from trainer.weights.from_checkpoint import model_from_run
from trainer.weights.init_source import check_init_source, find_init_source

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 50257
# the tiny MoE as transformers spells it: llama_tiny's attention (GQA 4 q / 2 kv heads, untied head)
# with QK-norm, 4 experts of width 32, top 2; decoder_sparse_step 2 keeps layer 0 dense (width 192)
HF_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.01)
MOE = ["model.qk_norm=true", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32",
       "model.moe.norm_topk_prob=true", "model.moe.aux_loss_coef=0.01"]


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its Hugging Face folders have a
    GPT-2-sized vocabulary."""
    return gpt2_data_dir


def moe_overrides(every: int = 1, *extra: str) -> list[str]:
    return ["model=llama_tiny", *MOE, f"model.moe.every={every}", *extra]


def hf_moe_folder(folder: Path, stacked: bool = False, **overrides) -> Path:
    """A transformers Qwen3MoeForCausalLM of the tiny MoE's shape, random and perturbed (norms off
    their 1, the router off its zeros), saved the Hub's way or, `stacked`, transformers 5's own."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**{**HF_SHAPE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # transformers initializes the router to zeros
                p.normal_(0, 0.5)
    perturbed(model).save_pretrained(folder, save_original_format=not stacked)
    return folder


def max_diff(ours, reference, x) -> float:
    with torch.no_grad():
        return (ours(x)[0][..., :VOCAB] - reference(x).logits).abs().max().item()


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("every, extra", [(1, []), (2, ["model.moe.norm_topk_prob=false"]),
                                          (1, ["model.tie_embeddings=true", "model.pad_vocab_multiple=64"]),
                                          (1, ["model.moe.expert_hidden=null"])],  # 192 / top_k 2
                         ids=["all_moe", "dense_layer0_unnormalized", "tied_pad64", "expert_hidden_null"])
def test_the_mapping_gives_transformers_logits(every, extra, tmp_path):
    model = perturbed(build_model(compose(moe_overrides(every, *extra)).model))
    safetensors_torch.save_file(to_hf_state_dict(model), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (config["model_type"], config["decoder_sparse_step"], config["num_experts"]) == ("qwen3_moe", every, 4)
    width = 96 if "model.moe.expert_hidden=null" in extra else 32
    assert config["moe_intermediate_size"] == model.config.expert_hidden == width
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reference).__name__ == "Qwen3MoeForCausalLM"
    assert reference.config.norm_topk_prob == ("model.moe.norm_topk_prob=false" not in extra)
    assert type(reference.model.layers[0].mlp).__name__ == ("Qwen3MoeSparseMoeBlock" if every == 1 else "Qwen3MoeMLP")
    assert max_diff(model, reference, tokens(2)) < 1e-5


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_init_from_a_transformers_folder_gives_its_logits(stacked, tmp_path):
    folder = hf_moe_folder(tmp_path / "hf", stacked, decoder_sparse_step=2)
    names = safetensors_torch.load_file(str(folder / "model.safetensors")).keys()
    assert ("model.layers.1.mlp.experts.gate_up_proj" in names) == stacked
    assert ("model.layers.1.mlp.experts.3.up_proj.weight" in names) == (not stacked)
    model = loaded_model(folder, *moe_overrides(2)[1:], model="llama_tiny")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_diff(model, reference, tokens(4)) < 1e-5


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_a_shard_reads_only_its_experts_rows(stacked, tmp_path):
    """Any region of an expert tensor (an FSDP or ep shard: some experts, or some rows of each) is
    the same region of transformers' stacked gate_up_proj / down_proj, in either file layout."""
    folder = hf_moe_folder(tmp_path / "hf", stacked)
    full = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    parts = llama_parts(find_init_source(str(folder)).shape)
    with SafetensorsFolder(safetensors, [folder / "model.safetensors"]) as files:
        for ours, theirs in (("c_fc", "gate_up_proj"), ("c_proj", "down_proj")):
            name, want = f"transformer.h.1.mlp.experts.{ours}", full[f"model.layers.1.mlp.experts.{theirs}"]
            rows, cols = want.shape[1:]
            for offsets, sizes in (((0, 0, 0), want.shape), ((1, 0, 0), (2, rows, cols)),
                                   ((3, 0, 0), (1, rows, cols)), ((1, rows // 2 - 3, 5), (3, rows // 2, cols - 5))):
                got = read_expert_region(files, name, parts[name], offsets, sizes, rows)
                region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assert torch.equal(got, want[region]), (ours, offsets, sizes)


def write_config(folder: Path, **overrides) -> Path:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **HF_SHAPE, **overrides}))
    return folder


def test_config_json_keys_map_to_model_moe(tmp_path):
    """transformers 5 writes num_local_experts, Qwen's own files num_experts; mlp_only_layers is read
    when a model.moe.every makes the same layers dense, and refused by name otherwise."""
    shape = find_init_source(str(write_config(tmp_path / "a"))).shape
    assert {k: v for k, v in shape.items() if k.startswith("moe.")} == {
        "moe.num_experts": 4, "moe.top_k": 2, "moe.expert_hidden": 32, "moe.every": 1, "moe.norm_topk_prob": True,
        "moe.num_shared_experts": 0}
    assert shape["qk_norm"] and shape["mlp_hidden"] is None  # no dense layer: its width is not compared
    local = {k: v for k, v in HF_SHAPE.items() if k != "num_experts"}
    local_shape = find_init_source(str(write_config(tmp_path / "b", **local, num_local_experts=4))).shape
    assert local_shape["moe.num_experts"] == 4
    # (mlp_only_layers, decoder_sparse_step) -> (model.moe.num_experts, model.moe.every), None: refused
    for i, (only, step, want) in enumerate((([0], 1, (4, 2)), ([], 2, (4, 2)), ([0, 1], 1, (0, None)),
                                            ([1], 1, None))):
        folder = write_config(tmp_path / f"only{i}", num_hidden_layers=2, mlp_only_layers=only,
                              decoder_sparse_step=step)
        if want:
            got = find_init_source(str(folder)).shape
            assert (got["moe.num_experts"], got["moe.every"]) == want
        else:
            with pytest.raises(CheckpointError, match=re.escape(f"qwen3_moe variant dtrain's model cannot reproduce "
                                                                f"(mlp_only_layers={only} with decoder_sparse_step=1")):
                find_init_source(str(folder))
    # a head width apart from hidden / heads (Qwen3-30B-A3B's 128 at 2048 / 32) is model.head_dim
    assert find_init_source(str(write_config(tmp_path / "head", head_dim=32))).shape["head_dim"] == 32


def test_init_from_mismatches_name_the_moe_key(tmp_path):
    folder = hf_moe_folder(tmp_path / "hf")
    cfg = compose(moe_overrides(1, "model.moe.top_k=1", f"model.init_from={folder}")).model
    with pytest.raises(ConfigError, match="moe.top_k=2, .* moe.top_k=1; set model.moe.top_k=2"):
        check_init_source(str(folder), cfg)
    dense = compose(["model=llama_tiny", "model.qk_norm=true", f"model.init_from={folder}"]).model
    with pytest.raises(ConfigError, match="set model.moe.num_experts=4 .*model.moe.every=1"):
        check_init_source(str(folder), dense)


@pytest.mark.parametrize("extra, needle", [
    (["model.moe.num_shared_experts=1"], "model.moe.num_shared_experts=1 (Qwen3-MoE has no shared experts)"),
    (["model.qk_norm=false"], "model.qk_norm=false (Qwen3-MoE always has QK-norm)"),
], ids=["shared_experts", "no_qk_norm"])
def test_export_of_what_qwen3_moe_lacks_is_refused(extra, needle):
    model = build_model(compose(moe_overrides(1, *extra)).model)
    with pytest.raises(ConfigError, match="is a mixture of experts, and Qwen3-MoE .* lacks") as err:
        to_hf_state_dict(model)
    assert needle in str(err.value)


@pytest.mark.slow
def test_round_trip_through_a_run_keeps_weights_and_logits(data_dir, tmp_path):
    """The issue's round trip: a transformers folder, `dtrain train model.init_from=` one step at lr
    1e-9, `dtrain export`, transformers again: every tensor within what one AdamW step of 1e-9 moves
    it (1e-8 covers Adam's unit steps and fp32 rounding) and the logits within 1e-5."""
    folder = hf_moe_folder(tmp_path / "hf", decoder_sparse_step=2)
    run_dir, out = tmp_path / "run", tmp_path / "export"
    args = tiny_args(data_dir, run_dir, "train.max_steps=1", "optim.lr=1e-9", "optim.min_lr=0",
                     f"model.init_from={folder}")
    args[args.index("model=tiny")] = "model=llama_tiny"
    run_dtrain([*args, *moe_overrides(2)[1:]], check=True)
    run_dtrain(["export", str(run_dir), "--out", str(out)], check=True)
    before = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    after = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(after).__name__ == "Qwen3MoeForCausalLM"
    want, got = before.state_dict(), after.state_dict()
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert 0 < worst < 1e-8, worst  # the step did move them
    x = tokens(5)
    with torch.no_grad():
        assert (after(x).logits - before(x).logits).abs().max().item() < 1e-5
    model, _ = model_from_run(run_dir)
    assert max_diff(model.eval(), after, x) < 1e-5


@pytest.mark.slow
def test_export_of_shared_experts_is_one_line_and_writes_nothing(data_dir, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = tiny_args(data_dir, run_dir, "train.max_steps=1")
    args[args.index("model=tiny")] = "model=llama_tiny"
    run_dtrain([*args, *moe_overrides(1, "model.moe.num_shared_experts=1")[1:]], check=True)
    line = one_line_error(run_dtrain(["export", str(run_dir), "--out", str(out)]))
    assert "Qwen3-MoE has no shared experts" in line and not out.exists()


def test_export_family_is_qwen3_moe_only_with_experts():
    assert export_family({**compose(moe_overrides(2)).model}) == "qwen3_moe"
    assert export_family({**compose(["model=llama_tiny", "model.qk_norm=true"]).model}) == "qwen3"


@pytest.mark.slow
def test_fsdp_world2_starts_from_the_moe_folder(data_dir, tmp_path):
    """A real `dtrain train parallel=fsdp world=2` from a Qwen3MoeForCausalLM folder, each rank
    reading only its experts of the expert tensors' shards: the step-0 weights give transformers'
    logits (the step is poisoned and skipped: the product's fault hook)."""
    folder = hf_moe_folder(tmp_path / "hf", decoder_sparse_step=2)
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "parallel=fsdp", "world=2", "train.max_steps=1", "train.on_nonfinite=skip",
                     f"model.init_from={folder}")
    args[args.index("model=tiny")] = "model=llama_tiny"
    proc = run_dtrain([*args, *moe_overrides(2)[1:]], env={**dtrain_env(), "DTRAIN_INJECT_NONFINITE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, _ = model_from_run(run_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_diff(model.eval(), reference, tokens(6)) < 1e-5
