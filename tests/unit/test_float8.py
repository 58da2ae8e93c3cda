"""train.float8 with torchao's emulation on the CPU: which layers convert (auto only the wide ones,
never the head), the state dict and the Hugging Face export unchanged by conversion, a DCP round trip,
and bad values, combinations and a CPU auto as documented. Runs: tests/parallel/test_float8_workers.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.config.compose import compose
from trainer.config.keys import key_kind, run_identity
from trainer.config.schema import to_dict
from trainer.config.validation import validate
from trainer.errors import ConfigError
from trainer.huggingface.mapping import to_hf_state_dict
from trainer.model.float8 import FLOAT8_MIN_DIM, convert_float8, float8_layers, resolve_float8
from trainer.model.gpt import build_model

torchao = pytest.importorskip("torchao", reason="the float8 extra (make test installs it)")
CPU = torch.device("cpu")


def _meta_model(*overrides: str):
    with torch.device("meta"):  # shapes only: a 1B model's names without its memory
        return build_model(compose(list(overrides)).model)


def test_auto_converts_only_matrices_wide_both_ways_and_never_the_head():
    wide = _meta_model("model=llama3_1b")  # 2048 wide, SwiGLU 8192: every block matrix passes
    names = float8_layers(wide, "auto")
    assert len(names) == 4 * 16 and "lm_head" not in names
    assert all(min(wide.get_submodule(n).weight.shape) >= FLOAT8_MIN_DIM for n in names)
    assert float8_layers(_meta_model("model=gpt2_124m"), "auto") == []  # 768 wide: the casts cost more
    # a matrix narrow one way stays: llama_135m's 576 x 1536 MLP
    assert float8_layers(_meta_model("model=llama_135m"), "auto") == []
    every = float8_layers(_meta_model("model=gpt2_124m"), "tensorwise")
    assert len(every) == 4 * 12 and "lm_head" not in every


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_keeps_the_weights_their_names_and_the_export(recipe):
    cfg = compose(["model=llama_tiny"])
    torch.manual_seed(0)
    plain, converted = build_model(cfg.model), build_model(cfg.model)
    converted.load_state_dict(plain.state_dict())
    names = convert_float8(converted, recipe, CPU)
    assert len(names) == 8 and type(converted.get_submodule(names[0])).__name__ == "Float8Linear"
    assert type(converted.lm_head) is torch.nn.Linear
    assert list(converted.state_dict()) == list(plain.state_dict())
    assert all(v.dtype == torch.float32 for v in converted.state_dict().values())  # high precision
    want, got = to_hf_state_dict(plain), to_hf_state_dict(converted)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    x = torch.randint(0, 256, (2, 32))
    loss, reference = converted(x, x)[1], plain(x, x)[1]
    assert loss.item() != reference.item() and abs(loss.item() - reference.item()) < 1e-2  # float8 rounds
    loss.backward()
    assert converted.get_submodule(names[0]).weight.grad is not None


def test_a_dcp_round_trip_of_a_converted_model(tmp_path):
    cfg = compose(["model=tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    convert_float8(model, "tensorwise", CPU)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "ckpt")
    for converted in (True, False):  # into a converted model, and into a plain one (the export's)
        torch.manual_seed(1)
        other = build_model(cfg.model)
        if converted:
            convert_float8(other, "tensorwise", CPU)
        state = other.state_dict()
        dcp.load(state, checkpoint_id=tmp_path / "ckpt")
        other.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


def test_settings_resolve_and_bad_ones_are_one_line():
    assert resolve_float8("off", CPU) == "off"
    assert resolve_float8("auto", CPU) == "off"  # emulation is for tests, never chosen by auto
    assert resolve_float8("tensorwise", CPU) == "tensorwise"  # emulated
    with pytest.raises(ConfigError, match="train.float8='fp8' is unknown; choose one of off, tensorwise"):
        validate(compose(["train.float8=fp8"]))
    with pytest.raises(ConfigError, match="train.float8=rowwise with parallel.tp=2: tensor parallelism"):
        validate(compose(["train.float8=rowwise", "parallel=fsdp", "parallel.tp=2", "model.n_head=2"]))


def test_float8_is_a_trajectory_key_that_leaves_older_runs_folders_alone():
    assert key_kind("train.float8") == "trajectory"
    off, on = (to_dict(compose([f"train.float8={s}"])) for s in ("off", "tensorwise"))
    without = to_dict(compose([]))
    del without["train"]["float8"]  # the record of a run from before the key
    assert run_identity(off) == run_identity(without) != run_identity(on)
