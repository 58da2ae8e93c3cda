"""Verified checkpoints: every file's checksum in the COMPLETE marker, checked before any load.

Faults are real: bytes flipped in a real shard, a real file deleted. A corrupt newest checkpoint
is set aside as corrupt_step_N and resume=auto falls back to the newest intact one; an explicit
resume=PATH, eval, sample and export refuse a corrupt checkpoint with one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.checkpoints import copy_whole_run, flip, loss_records, same_weights
from helpers.dtrain import run_dtrain, tiny_args
from helpers.errors import one_line_error
from helpers.runs import CKPT_ARGS, CKPT_NAMES, RESUMED

from trainer.checkpoint.integrity import CHECKSUM_ALGO, CorruptCheckpoint, verify_checkpoint_files
from trainer.checkpoint.layout import MARKER, latest_checkpoint
from trainer.checkpoint.verify import validate_checkpoint


def damage(kind: str, ckpt: Path) -> str:
    """Damage a checkpoint for real; returns what the error must name."""
    shard = ckpt / "__0_0.distcp"
    if kind == "flip middle":
        flip(shard, shard.stat().st_size // 2)
        return f"__0_0.distcp: {CHECKSUM_ALGO} mismatch"
    if kind == "flip first bytes":
        flip(shard, 0)
        return f"__0_0.distcp: {CHECKSUM_ALGO} mismatch"
    if kind == "delete .metadata":
        (ckpt / ".metadata").unlink()
        return "missing .metadata"
    raise ValueError(kind)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def resumed_from_older(data_dir, references, module_tmp) -> Path:
    """The reference run continued from its intact step 6 by an explicit resume=PATH."""
    run_dir = module_tmp.mktemp("from_step_6") / "run"
    ckpts = copy_whole_run(references("none"), run_dir)
    run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED, f"resume={ckpts / CKPT_NAMES[1]}"), check=True)
    return run_dir


@pytest.mark.parametrize("kind", ["flip middle", pytest.param("flip first bytes", marks=pytest.mark.slow),
                                  pytest.param("delete .metadata", marks=pytest.mark.slow)])
def test_corrupt_newest_checkpoint_falls_back_to_the_intact_one(kind, data_dir, references, resumed_from_older,
                                                              tmp_path):
    reference = references("none")
    run_dir = tmp_path / "run"
    ckpts = copy_whole_run(reference, run_dir)
    newest = ckpts / CKPT_NAMES[-1]
    expected = damage(kind, newest)
    damaged = snapshot(newest)

    proc = run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED))  # resume=auto
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "is corrupt" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"checkpoint {newest} is corrupt ({expected}" in lines[0], lines[0]
    assert "moved it to corrupt_step_000008 and falling back to step_000006" in lines[0], lines[0]
    assert f"resuming from {ckpts / CKPT_NAMES[1]} (step 6)" in proc.stderr
    # Set aside with every file as it was (damage included), never deleted; retention ignored it.
    assert snapshot(ckpts / "corrupt_step_000008") == damaged
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "corrupt_step_000008", "step_000003", "step_000006", "step_000009"]
    # Bit for bit the run an explicit resume from step 6 gives.
    assert loss_records(run_dir) == loss_records(resumed_from_older)
    assert same_weights(run_dir, resumed_from_older)


def test_explicit_corrupt_checkpoint_names_the_intact_one(data_dir, references, tmp_path):
    ckpts = copy_whole_run(references("none"), tmp_path / "old")
    newest = ckpts / CKPT_NAMES[-1]
    expected = damage("flip middle", newest)
    before = {p.name: snapshot(p) for p in ckpts.iterdir()}
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", *CKPT_ARGS, *RESUMED, f"resume={newest}"))
    line = one_line_error(proc)
    intact = ckpts / CKPT_NAMES[1]
    assert f"checkpoint {newest} is corrupt ({expected}" in line, line
    assert f"the newest intact checkpoint is {intact}: resume={intact}" in line, line
    assert {p.name: snapshot(p) for p in ckpts.iterdir()} == before  # nothing moved for an explicit PATH
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("command", ["export", "sample"])
def test_export_and_sample_refuse_a_corrupt_checkpoint(command, references, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = copy_whole_run(references("none"), run_dir)
    expected = damage("flip first bytes", ckpts / CKPT_NAMES[-1])
    extra = ["--tokens", "5", "--device", "cpu"] if command == "sample" else ["--out", str(tmp_path / "out")]
    line = one_line_error(run_dtrain([command, str(run_dir), *extra]))
    assert f"checkpoint {ckpts / CKPT_NAMES[-1]} is corrupt ({expected}" in line, line
    assert f"the newest intact checkpoint is {ckpts / CKPT_NAMES[1]}" in line, line
    assert not (tmp_path / "out").exists()


# --- in-process: what the marker records and what verification catches -----------------------------
def test_marker_records_every_file(references):
    ckpt = latest_checkpoint(references("none"))
    marker = json.loads((ckpt / MARKER).read_text())
    names = sorted(p.name for p in ckpt.iterdir() if p.name != MARKER)
    assert sorted(marker["files"]) == sorted(marker["bytes"]) == names
    assert {"__0_0.distcp", ".metadata", "trainer_state.json", "config.json"} <= set(names)
    assert marker["checksum"] == CHECKSUM_ALGO
    assert all(value.startswith(f"{CHECKSUM_ALGO}:") for value in marker["files"].values())
    assert all(marker["bytes"][n] == (ckpt / n).stat().st_size for n in names)
    assert verify_checkpoint_files(ckpt) is True


@pytest.mark.parametrize(("fault", "expected"), [
    ("extra file", "unexpected file notes.txt"),
    ("appended bytes", "corrupt trainer_state.json: "),
    ("truncated shard", "truncated shard file __0_0.distcp"),
    ("flipped config", f"config.json: {CHECKSUM_ALGO} mismatch"),
])
def test_verification_names_the_damaged_file(fault, expected, references, tmp_path):
    ckpt = tmp_path / "step_000008"
    shutil.copytree(latest_checkpoint(references("none")), ckpt)
    if fault == "extra file":
        (ckpt / "notes.txt").write_text("hi")
    elif fault == "appended bytes":
        with (ckpt / "trainer_state.json").open("a") as f:
            f.write(" ")
    elif fault == "truncated shard":
        shard = ckpt / "__0_0.distcp"
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size - 1)
    else:
        flip(ckpt / "config.json", 10, 1)
    with pytest.raises(CorruptCheckpoint, match=expected) as info:
        validate_checkpoint(ckpt)
    assert str(info.value).startswith(f"checkpoint {ckpt} is corrupt (")


def test_checkpoint_without_checksums_still_loads(references, tmp_path, capsys):
    """A checkpoint from before checksums (its marker names no files) loads, with one line saying so."""
    ckpt = tmp_path / "step_000008"
    shutil.copytree(latest_checkpoint(references("none")), ckpt)
    (ckpt / MARKER).write_text(json.dumps({"step": 8, "world": 1, "format": 1}))
    _, state, _ = validate_checkpoint(ckpt)
    assert state["step"] == 8
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"dtrain: checkpoint {ckpt} has no checksums (written before dtrain recorded them); "
                     "loading it unverified"]
