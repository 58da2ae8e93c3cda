"""Hydra's own flags behave as in any Hydra app (issue 34): a user's --config-dir preset composes and
trains (single run and sweep), --config-path / --config-name pick the primary config, an unknown
config name is one `error:` line with nothing written; and the default run directory is named by
what the run learns, so the same command finds the same folder."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from helpers.dtrain import args_with, read_metrics, run_dtrain, tiny_args
from helpers.errors import assert_user_error
from omegaconf import OmegaConf

from trainer.cli import main
from trainer.config.command_line import ConfigSource, config_source, hydra_args, split_args
from trainer.config.compose import compose, default_run_name, sweep_points
from trainer.launch.sweep import pin_sweep_dir

PRESET = """\
# @package _global_
train:
  max_steps: 2
  log_interval: 1
optim:
  lr: 0.00123
"""


def user_config_dir(root: Path) -> Path:
    """A folder of the user's own: an experiment preset dtrain does not ship."""
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(PRESET)
    return root


def test_config_dir_preset_composes_and_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    mine = user_config_dir(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    source = config_source(["--config-dir", "mine", "experiment=mine"])
    assert source.config_dirs == (mine,)
    assert hydra_args(["-cd", "mine", "experiment=mine"]) == [f"--config-dir={mine}", "experiment=mine"]
    cfg = compose(["experiment=mine"], source=source)
    assert cfg.optim.lr == 0.00123 and cfg.train.max_steps == 2
    # the command line's own hydra.searchpath is kept beside --config-dir's folder
    other = user_config_dir(tmp_path / "other")
    (other / "experiment" / "theirs.yaml").write_text(PRESET.replace("0.00123", "0.00456"))
    both = compose(["experiment=theirs", f"hydra.searchpath=[file://{other}]"], source=source)
    assert both.optim.lr == 0.00456


def test_config_path_and_config_name_pick_the_primary_config(tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "lab.yaml").write_text(textwrap.dedent("""\
        defaults:
          - config
          - _self_
        train:
          seed: 77
        """))
    # the user's primary config builds on dtrain's own (found through --config-dir)
    source = config_source(["--config-path", str(own), "--config-name", "lab", "--config-dir",
                            str(ConfigSource().config_path)])
    cfg = compose([], source=source)
    assert cfg.train.seed == 77 and cfg.model.name == "cpu_small"
    proc = run_dtrain(["train", "-cp", str(own), "-cn", "lab", "-cd", str(ConfigSource().config_path),
                       "--cfg", "job"], check=True)
    assert "seed: 77" in proc.stdout


@pytest.mark.parametrize("extra", [[], ["--cfg", "job"], ["-m", "optim.lr=1e-3,2e-3"]])
def test_an_unknown_config_name_is_one_line_and_nothing_is_written(tmp_path, extra):
    proc = run_dtrain(["train", "--config-name", "nonexistent", f"hydra.run.dir={tmp_path / 'run'}",
                       f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra], cwd=tmp_path)
    assert_user_error(proc, "Cannot find primary config 'nonexistent'")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_config_dir_that_is_not_there_is_one_line(tmp_path):
    proc = run_dtrain(["train", "--config-dir", str(tmp_path / "nope"), "experiment=mine"], cwd=tmp_path)
    assert_user_error(proc, "--config-dir", "no such folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_config_dir_preset_trains_a_single_run(data_dir, tmp_path):
    mine = user_config_dir(tmp_path / "mine")
    run_dir = tmp_path / "run"
    args = [a for a in tiny_args(data_dir, run_dir) if not a.startswith(("train.max_steps", "train.log_interval"))]
    run_dtrain([args[0], "--config-dir", str(mine), "experiment=mine", *args[1:]], check=True)
    assert json.loads((run_dir / "resolved_config.json").read_text())["optim"]["lr"] == 0.00123
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_config_dir_preset_trains_every_point_of_a_sweep(data_dir, tmp_path):
    mine = user_config_dir(tmp_path / "mine")
    args = [a for a in tiny_args(data_dir, tmp_path / "unused") if not a.startswith(
        ("train.max_steps", "train.log_interval", "hydra.run.dir"))]
    sweep = tmp_path / "sweep"
    run_dtrain([args[0], "-m", "--config-dir", str(mine), "experiment=mine", "train.seed=1,2",
                f"hydra.sweep.dir={sweep}", *args[1:]], check=True)
    for point in ("0", "1"):
        assert json.loads((sweep / point / "resolved_config.json").read_text())["optim"]["lr"] == 0.00123


def test_sweep_points_follow_hydras_basic_sweeper():
    assert sweep_points(["a=1,2", "b=x,y", "c=3"]) == [
        ["a=1", "b=x", "c=3"], ["a=1", "b=y", "c=3"], ["a=2", "b=x", "c=3"], ["a=2", "b=y", "c=3"]]
    assert sweep_points(["a=1,2", "a=3"]) == [["a=3"]]  # a key given twice: its place, the last value


def run_dir_of(*overrides: str) -> str:
    cfg = compose(list(overrides), return_hydra_config=True)
    return str(cfg.hydra.run.dir)


def test_the_default_run_dir_is_named_by_the_trajectory_keys():
    base = run_dir_of("model=tiny")
    assert base.startswith("outputs/tiny-shakespeare-") and base == run_dir_of("model=tiny")
    # how the run is launched, watched or saved: the same run, the same folder
    for operational in ("world=2", "parallel=ddp", "train.log_interval=3", "checkpoint.interval=7",
                        "train.total_batch_size=2048"):
        assert run_dir_of("model=tiny", operational) == base, operational
    # what it learns: another run, another folder
    for trajectory in ("optim.lr=1e-3", "train.seed=3", "train.max_steps=5", "model.n_layer=3"):
        assert run_dir_of("model=tiny", trajectory) != base, trajectory
    assert run_dir_of("model=tiny", "hydra.run.dir=elsewhere") == "elsewhere"


def test_the_run_name_sees_init_from_as_the_run_records_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = compose(["model.init_from=src"], return_hydra_config=True)
    absolute = compose([f"model.init_from={tmp_path / 'src'}"], return_hydra_config=True)
    assert default_run_name(relative) == default_run_name(absolute)
    assert OmegaConf.select(relative, "hydra.run.dir") == OmegaConf.select(absolute, "hydra.run.dir")


# Issue 45, finding 12: Hydra's flags beside a bad override, or beside one another, were Hydra's
# ConfigCompositionException or ValueError traceback (exit 1) or its usage page. Each is one line.
BAD_FLAG_USES = {
    "--help nosuch.key=1": "nosuch is not a config key",
    "--hydra-help nosuch.key=1": "nosuch is not a config key",
    "-m --help nosuch.key=1": "nosuch is not a config key",
    "--help optim.lr=abc": "optim.lr=abc",
    "--help model=nosuch": "Could not find 'model/nosuch'",
    "-m --help optim.lr=1e-3,2e-3": "-m sweeps optim.lr: give each key one value",
    "--cfg job nosuch.key=1": "nosuch is not a config key",
    "--cfg nosuch.key=1": "--cfg takes one of job, hydra, all before the overrides; e.g. dtrain train --cfg job",
    "--info nosuch.key=1": "--info takes one of all, config",
    "-m --cfg job model=tiny": "-m and --cfg: Hydra does one of",
    "--info -m": "-m and --info",
    "--cfg job --info": "--cfg and --info",
    "-m --resolve": "--resolve",
}


@pytest.mark.parametrize("typed", list(BAD_FLAG_USES))
def test_hydra_flags_beside_a_bad_override_are_one_line(typed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *typed.split()])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, err
    assert BAD_FLAG_USES[typed] in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_bare_info_keeps_the_overrides_hydra_sees_after_it(tmp_path):
    """--config-dir's folder goes first for Hydra: `--info` then stood before an override, which
    Hydra's argparse took for --info's word."""
    args = ["--info", "--config-dir", str(tmp_path), "model=tiny"]
    assert split_args(args) == (["model=tiny"], False)
    assert hydra_args(args) == [f"--config-dir={tmp_path}", "--info=all", "model=tiny"]


def test_help_with_a_bad_override_is_one_line_as_typed(tmp_path):
    assert_user_error(run_dtrain(["train", "--help", "nosuch.key=1"], cwd=tmp_path), "nosuch is not a config key")
    assert list(tmp_path.iterdir()) == []


def test_hydra_job_chdir_reads_the_data_of_the_folder_the_command_was_typed_in(data_dir, tmp_path):
    """Issue 45, finding 15: with hydra.job.chdir=true the job ran inside its run directory and looked
    for a relative data.dir there, after the run directory was written. Relative paths are taken
    from the folder the command was typed in, as model.init_from always was."""
    run_dir = tmp_path / "run"
    relative = os.path.relpath(data_dir, tmp_path)
    run_dtrain(args_with(data_dir, run_dir, f"data.dir={relative}", "train.max_steps=2", "hydra.job.chdir=true"),
               cwd=tmp_path, check=True)
    assert json.loads((run_dir / "resolved_config.json").read_text())["data"]["dir"] == str(tmp_path / relative)
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]


def test_the_run_name_under_chdir_sees_data_dir_as_the_run_records_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = compose(["hydra.job.chdir=true", "data.dir=data"], return_hydra_config=True)
    absolute = compose(["hydra.job.chdir=true", f"data.dir={tmp_path / 'data'}"], return_hydra_config=True)
    assert OmegaConf.select(relative, "hydra.run.dir") == OmegaConf.select(absolute, "hydra.run.dir")


def test_the_default_sweep_dir_is_named_by_the_sweep(tmp_path, monkeypatch):
    """Issue 45, finding 17: it was multirun/<date>/<time>, so the same -m command started over in
    another folder, and only an explicit hydra.sweep.dir= continued a sweep."""
    monkeypatch.chdir(tmp_path)

    def sweep_dir(*overrides: str) -> Path:
        args, folder = pin_sweep_dir(["-m", "model=tiny", *overrides])
        assert sum(a.startswith("hydra.sweep.dir=") for a in args) == 1  # what Hydra is told
        return folder

    lr = sweep_dir("optim.lr=1e-3,3e-3")
    assert lr.parent == Path("multirun") and lr.name.startswith("optim.lr-")
    assert sweep_dir("optim.lr=1e-3,3e-3") == lr
    assert sweep_dir("optim.lr=1e-3,3e-3", "sweep.fail_fast=true") == lr  # how the sweep runs, not what
    assert sweep_dir("optim.lr=1e-3,1e-2") != lr
    assert sweep_dir("optim=adamw,muon", "train.seed=0,1").name.startswith("optim_train.seed-")
    assert sweep_dir("optim.lr=1e-3,3e-3", "hydra.sweep.dir=mine") == Path("mine")
    assert list(tmp_path.iterdir()) == []
