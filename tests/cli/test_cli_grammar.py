"""The command line's small promises (issue 34): `dtrain --version` (and `dtrain train --version`,
which is dtrain's, not Hydra's), a misspelt key's suggestion that ranks the likely key first, the
renamed keys' old names, and every command's flags also written as `name=value`."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from helpers.checkpoints import checkpointed_tiny_run
from helpers.dtrain import read_metrics, run_dtrain, tiny_args
from helpers.errors import assert_user_error

from trainer.config.compose import closest_key, compose
from trainer.config.schema import from_dict, schema_keys


@pytest.mark.parametrize("args", [["--version"], ["train", "--version"]])
def test_version_names_dtrain_and_torch(args):
    proc = run_dtrain(args, check=True)
    assert proc.stdout.strip().startswith(f"dtrain {version('dtrain')} (torch {version('torch')}")
    assert "Hydra" not in proc.stdout


@pytest.mark.parametrize("typed,meant", [
    ("optim.learning_rate", "optim.lr"),  # spelled out where the schema abbreviates
    ("optim.wd", "optim.weight_decay"),  # abbreviated where the schema spells out
    ("train.mbs", "train.micro_batch_size"),
    ("train.max_step", "train.max_steps"),  # a spelling slip within the section
    ("model.nlayer", "model.n_layer"),
    ("trian.seed", "train.seed"),  # the section misspelt
])
def test_a_misspelt_key_suggests_the_likely_key_first(typed, meant):
    assert closest_key(typed, schema_keys()) == meant


def test_the_suggestion_reaches_the_error_line():
    proc = run_dtrain(["train", "optim.learning_rate=1e-3", "--cfg", "job"])
    assert_user_error(proc, "optim.learning_rate is not a config key; did you mean optim.lr?")


# --- renamed keys: the old names still work, with a notice (trainer/config/keys.py RENAMED_KEYS) -------

def test_old_key_names_set_the_new_keys():
    # eval_batches is val_batches' older name; val_batches micro batches are val_tokens at the run's
    # micro batch and seq_len (the schema's 8 x 128)
    cfg = compose(["train.eval_interval=7", "train.eval_batches=3", "eval.interval=5"])
    assert (cfg.train.val_interval, cfg.train.val_tokens, cfg.eval.hellaswag.interval) == (7, 3 * 8 * 128, 5)
    assert cfg.train.eval_interval is None and cfg.train.eval_batches is None and cfg.eval.interval is None
    assert cfg.train.val_batches is None


def test_a_record_written_under_the_old_names_reads_as_the_new():
    cfg = from_dict({"train": {"eval_interval": 9, "eval_batches": 1, "micro_batch_size": 4, "seq_len": 64},
                     "eval": {"interval": 4}})
    assert (cfg.train.val_interval, cfg.train.val_tokens, cfg.eval.hellaswag.interval) == (9, 256, 4)


def test_val_batches_is_val_tokens_with_one_line_saying_why(capsys):
    """train.val_batches counted micro batches: it sets the tokens it read, and says so once."""
    cfg = compose(["train.val_batches=2", "train.micro_batch_size=4", "train.seq_len=64", "train.val_tokens=99"])
    assert (cfg.train.val_tokens, cfg.train.val_batches) == (512, None)  # the old key wins, as written
    lines = [line for line in capsys.readouterr().err.splitlines() if "val_batches" in line]
    assert lines == ["dtrain: train.val_batches=2 is now train.val_tokens=512 (2 x micro batch 4 x seq_len 64): the "
                     "validation set is a number of tokens and no longer moves with the micro batch; set "
                     "train.val_tokens instead"]
    assert compose(["train.val_batches=0"]).train.val_tokens == 0  # still no validation


@pytest.mark.slow
def test_a_run_given_an_old_name_says_the_new_one_and_uses_it(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=2", "train.eval_interval=1")
    args.remove("train.val_interval=0")
    proc = run_dtrain(args, check=True)
    assert proc.stderr.count("dtrain: train.eval_interval is now train.val_interval") == 1, proc.stderr
    assert [r["step"] for r in read_metrics(run_dir) if "val_loss" in r] == [1, 2]  # every step, as asked


# --- one grammar: every flag also as name=value ---------------------------------------------------

@pytest.mark.slow
def test_flags_and_key_values_are_one_grammar(tmp_path):
    run_dir = tmp_path / "run"
    checkpointed_tiny_run(run_dir, [f"hydra.run.dir={run_dir}"], steps=1, tokens_per_step=32)
    flags = run_dtrain(["sample", str(run_dir), "--tokens", "6", "--seed", "3", "--top-k", "5", "--device", "cpu"],
                       check=True)
    keys = run_dtrain(["sample", str(run_dir), "tokens=6", "seed=3", "top_k=5", "device=cpu"], check=True)
    assert keys.stdout == flags.stdout and keys.stdout.strip()
    out = tmp_path / "hf"
    run_dtrain(["export", str(run_dir), f"out={out}", "dtype=float32"], check=True)
    assert (out / "model.safetensors").is_file()


def test_a_switch_as_a_key_takes_true_or_false():
    proc = run_dtrain(["prepare", "force=maybe"])
    assert_user_error(proc, "force='maybe': a switch takes true/false/1/0/yes/no")
