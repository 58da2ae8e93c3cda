"""A run folder's name survives an upgrade: the same command, typed again after dtrain gained a
trajectory key, finds and continues the run it started before (trainer/config/keys.py ADDED_KEYS).
In-process and torch-free."""

from __future__ import annotations

from omegaconf import OmegaConf

from trainer.config.compose import compose, default_run_name
from trainer.config.keys import ADDED_KEYS, TRAJECTORY, _matches
from trainer.io import dotted_keys
from trainer.preflight.rundir import trajectory_changes

# The default folders as every release since the run folder was named by its settings wrote them.
# A new trajectory key that changes one of these names must go into ADDED_KEYS (with the value that
# means what older runs did) instead, or users' runs start over after an upgrade.
NAMES_BEFORE = {
    (): "cpu_small-shakespeare-a5159ab2",
    ("model=tiny",): "tiny-shakespeare-ad66968e",
    ("experiment=shakespeare_cpu",): "cpu_small-shakespeare-24b180ec",
    ("data=tinyshakespeare", "optim=muon"): "cpu_small-tinyshakespeare-183ab228",
}


def job(overrides) -> dict:
    root = compose(list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(OmegaConf.masked_copy(root, [k for k in root if k != "hydra"]), resolve=True)


def test_the_default_run_folders_are_the_ones_older_releases_wrote():
    assert {o: default_run_name(compose(list(o), return_hydra_config=True)) for o in NAMES_BEFORE} == NAMES_BEFORE


def test_an_added_key_at_its_old_meaning_is_no_change_and_another_value_is():
    now = job([])
    older = {section: dict(values) if isinstance(values, dict) else values for section, values in now.items()}
    older["data"] = {k: v for k, v in now["data"].items() if k != "text_field"}  # a record written before it existed
    assert trajectory_changes(older, now) == []
    changed = job(["data.text_field=content"])
    assert trajectory_changes(older, changed) == ["data.text_field"]
    assert default_run_name(compose(["data.text_field=content"], return_hydra_config=True)) != NAMES_BEFORE[()]


def test_every_added_key_is_a_trajectory_key_of_the_schema():
    keys = dotted_keys(job([]))
    for key, value in ADDED_KEYS.items():
        assert key in keys and _matches(key, TRAJECTORY), key
        assert keys[key] == value, f"{key}'s default is not the value older records imply"
