"""Experiment presets (conf/experiment/) and the Makefile targets that use them."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from helpers.dtrain import REPO, read_metrics, run_dtrain, tokenizer_args

from trainer.config.batch import batch_plan
from trainer.config.compose import compose
from trainer.config.validation import validate


def preset(name: str, *overrides: str):
    cfg = compose([f"experiment={name}", *overrides])
    validate(cfg)
    return cfg


def test_gpt2_124m_fineweb_is_the_reference_recipe():
    cfg = preset("gpt2_124m_fineweb")
    assert cfg.data.name == "fineweb_edu" and cfg.model.name == "gpt2_124m"
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (12, 12, 768, 1024)
    assert cfg.model.pad_vocab_multiple == 64 and -(-cfg.model.vocab_size // 64) * 64 == 50304
    t, o = cfg.train, cfg.optim
    assert (t.total_batch_size, t.seq_len, t.micro_batch_size, t.max_steps) == (524288, 1024, 64, 19073)
    assert (o.lr, o.min_lr, o.warmup_steps, o.weight_decay, list(o.betas), o.grad_clip) == (
        6e-4, 6e-5, 715, 0.1, [0.9, 0.95], 1.0)
    assert (t.val_interval, cfg.eval.hellaswag.interval, cfg.checkpoint.interval) == (250, 250, 5000)
    # the same 2^19-token step on 8 GPUs (no accumulation) or on one (8 micro-steps)
    assert batch_plan(cfg, 8).grad_accum_steps == 1 and batch_plan(cfg, 1).grad_accum_steps == 8


def test_shakespeare_cpu_is_what_make_train_runs():
    cfg = preset("shakespeare_cpu")
    assert cfg.data.name == "shakespeare" and cfg.data.auto_prepare and cfg.model.name == "cpu_small"
    assert cfg.train.max_steps * cfg.train.micro_batch_size * cfg.train.seq_len <= 400_000  # minutes on a CPU
    makefile = (REPO / "Makefile").read_text()
    recipe = r"^train:.*\n\t\$\(DTRAIN\) train experiment=shakespeare_cpu \$\(ARGS\)$"
    assert re.search(recipe, makefile, re.M)


def test_the_sample_prompt_fits_any_corpus_and_the_shakespeare_presets_keep_theirs():
    """Issue 45, finding 18: "ROMEO:" began the end-of-run sample of every dataset."""
    assert compose(["data=text"]).train.sample_prompt == "\n"  # `dtrain sample`'s default too
    for name in ("shakespeare_cpu", "shakespeare_fast", "finetune_shakespeare"):
        assert compose([f"experiment={name}"]).train.sample_prompt == "ROMEO:", name


def test_command_line_overrides_beat_the_preset():
    cfg = preset("debug", "train.max_steps=3", "model=cpu_small")
    assert cfg.train.max_steps == 3 and cfg.model.name == "cpu_small"
    assert cfg.train.log_interval == 1  # the preset's value where the command line says nothing


@pytest.mark.slow
def test_debug_preset_runs_with_every_periodic_action(data_dir, tmp_path):
    run = tmp_path / "run"
    run_dtrain(["train", "experiment=debug", "data=text", "data.name=corpus", f"data.dir={data_dir}",
                *tokenizer_args(data_dir), f"hydra.run.dir={run}"], check=True)
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # every step logged
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6]
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_000002", "step_000004", "step_000006"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_help_lists_every_target_with_one_line():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z][a-zA-Z_-]*):(?!=)", makefile, re.M))  # not file targets
    assert {"train", "sweep", "report", "test", "help"} <= targets
    assert targets <= listed, f"targets without a '## ' line: {sorted(targets - listed)}"
    assert len(out.splitlines()) == len(listed)
