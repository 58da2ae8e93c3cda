"""The command line's small promises (issue 34): `dtrain --version` (and `dtrain train --version`,
which is dtrain's, not Hydra's), and a misspelt key's suggestion that ranks the likely key first."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from conftest import run_dtrain
from test_cli_errors import assert_user_error

from trainer.compose import closest_key
from trainer.config import schema_keys


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
