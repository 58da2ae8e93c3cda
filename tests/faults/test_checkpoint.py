"""Checkpoints: atomic DCP saves, bit-exact resume after kill -9 in every mode, resharding across
world sizes, and one-line errors for bad checkpoints (exit code 2, previous checkpoint intact)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import loss_records, same_weights
from helpers.dtrain import read_metrics, run_dtrain, tiny_args, train_losses
from helpers.errors import one_line_error
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import CKPT_ARGS, CKPT_NAMES, INTERVAL, RESUMED_MODES, STEPS, checkpointed

from trainer.checkpoint.layout import MARKER, checkpoint_step, is_complete, latest_checkpoint, list_checkpoints
from trainer.checkpoint.verify import read_metadata, validate_checkpoint
from trainer.errors import CheckpointError
from trainer.weights.from_checkpoint import load_model_weights, model_from_run

NEXT = "step_000009"  # what a resumed run with train.max_steps=9 saves (at its end)


# --- exactness: kill -9 and resume --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", [m for m in RESUMED_MODES if m != "none"])  # none: the busy-machine test below
def test_kill_and_resume_is_bitwise_identical(mode, data_dir, references, tmp_path):
    kill_and_resume_bitwise(mode, data_dir, references, tmp_path)


def test_bitwise_resume_holds_while_the_machine_is_busy(data_dir, references, tmp_path):
    """parallel=none's kill -9 and bitwise resume, on a busy machine: MKL and libgomp shrink their
    thread teams under load unless dynamic threading is off (trainer/__init__.py); two busy
    processes per core run through the killed run and its resume (the uninterrupted reference is
    made, or taken from the session, before they start: it is what the resumed run must equal)."""
    references("none")
    hog = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        kill_and_resume_bitwise("none", data_dir, references, tmp_path)
    finally:
        for proc in hog:
            proc.kill()
            proc.wait()


def kill_and_resume_bitwise(mode, data_dir, references, tmp_path):
    reference = references(mode)
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, *CKPT_ARGS, *checkpointed(mode))
    log = tmp_path / "killed.log"
    killed_at = kill_past_a_checkpoint(args, run_dir, log)
    resumed_from = checkpoint_step(latest_checkpoint(run_dir))
    assert killed_at < STEPS
    if mode == "none":
        # What a kill in the middle of a save leaves: a temporary folder and a folder with no
        # completion marker. Both are ignored, and removed on the next start.
        ckpts = run_dir / "checkpoints"
        (ckpts / ".tmp_step_000099").mkdir()
        (ckpts / ".tmp_step_000099" / "__0_0.distcp").write_bytes(b"partial")
        shutil.copytree(latest_checkpoint(run_dir), ckpts / "step_000007")
        (ckpts / "step_000007" / MARKER).unlink()
        assert checkpoint_step(latest_checkpoint(run_dir)) == resumed_from

    proc = run_dtrain(args)  # the same command: resume=auto
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints'}/step_{resumed_from:06d}" in proc.stderr
    records = loss_records(run_dir)
    assert [r[0] for r in records] == list(range(1, STEPS + 1)), "metrics.jsonl lost or repeated a step"
    # Every logged loss and grad norm, before and after the resume, equals the uninterrupted run's.
    assert records == loss_records(reference)
    assert same_weights(run_dir, reference)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == CKPT_NAMES, names  # partial saves cleaned up


# --- resharding: written at world 2, resumed at world 1 and 4 -------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("source", "target"), [
    ("ddp", ("parallel=none", "world=1")),
    ("fsdp", ("parallel=fsdp", "world=4")),
    ("zero", ("parallel=zero", "world=4")),  # row-sharded optimizer state, resharded by DCP
    ("zero", ("parallel=ddp", "world=1")),
    ("zero_torch", ("parallel=ddp", "world=1")),  # one rank reads what each owner saved
    ("zero", ("parallel=zero_torch", "world=2")),  # row shards read whole by each parameter's owner
])
def test_resume_at_another_world_size(source, target, data_dir, references, tmp_path):
    reference = references(source)
    run_dir = tmp_path / "resharded"
    total = 4 * 64 * 2 * 2  # the reference's global batch: accumulation adapts to the new world
    args = tiny_args(data_dir, run_dir, f"train.max_steps={STEPS}", f"train.total_batch_size={total}",
                     f"resume={reference / 'checkpoints' / CKPT_NAMES[0]}", *target)
    run_dtrain(args, check=True)
    want, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == list(range(INTERVAL + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)


# --- bad input: one clear line, exit code 2, the previous checkpoint intact -----------------------------
def copy_run(reference: Path, dest: Path) -> Path:
    """A run dir holding the reference's metrics, config record and newest checkpoint."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "resolved_config.json"):
        shutil.copy(reference / name, dest / name)
    newest = latest_checkpoint(reference)
    shutil.copytree(newest, dest / "checkpoints" / newest.name)
    return dest / "checkpoints" / newest.name


def _damage(kind: str, ckpt: Path) -> str:
    shard = sorted(ckpt.glob("*.distcp"))[-1]
    if kind == "missing shard":
        shard.unlink()
        return f"missing shard file {shard.name}"
    if kind == "truncated shard":
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        return f"truncated shard file {shard.name}"
    if kind == "garbage metadata":
        (ckpt / ".metadata").write_bytes(b"\x80\x04not a pickle")
        return "corrupt .metadata"
    if kind == "another model":
        return "written for another model"
    raise ValueError(kind)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "mode"), [
    ("truncated shard", "none"),
    ("another model", "ddp"),  # a worker's CheckpointError through the elastic launcher
])
def test_bad_checkpoint_is_one_clear_error(kind, mode, data_dir, references, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = copy_run(references(mode), run_dir)
    expected = _damage(kind, ckpt)
    before = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    extra = ("model.n_layer=3",) if kind == "another model" else ()
    # An explicit checkpoint: extending a finished run's schedule (max_steps 8 -> 9) takes one.
    proc = run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, "train.max_steps=9", *checkpointed(mode), *extra,
                                f"resume={ckpt}"))
    line = one_line_error(proc)
    assert expected in line and str(ckpt) in line, line
    assert {p.name: p.stat().st_size for p in ckpt.iterdir()} == before  # left as it was


@pytest.mark.parametrize("kind", ["missing shard", "truncated shard", "garbage metadata"])
def test_damaged_checkpoint_is_named(kind, references, tmp_path):
    """What a resume checks before any rank reads a tensor (the same checks as above, in-process)."""
    ckpt = copy_run(references("none"), tmp_path / "run")
    expected = _damage(kind, ckpt)
    with pytest.raises(CheckpointError, match=expected) as info:
        validate_checkpoint(ckpt)
    assert str(ckpt) in str(info.value)
    assert latest_checkpoint(tmp_path / "run") == ckpt  # still listed: the error names it


def test_resume_path_must_be_a_checkpoint(data_dir, tmp_path):
    from trainer.preflight.rundir import check_run_dir

    not_ckpt = tmp_path / "somewhere"
    not_ckpt.mkdir()
    (not_ckpt / "notes.txt").write_text("hi")
    partial = tmp_path / "old" / "checkpoints" / "step_000004"
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"")
    for path, expected in [(not_ckpt, "holds no complete checkpoint"), (partial, "incomplete checkpoint")]:
        with pytest.raises(CheckpointError, match=expected):
            check_run_dir(tmp_path / "run", str(path))
    missing = tmp_path / "missing"
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", f"resume={missing}"))
    line = one_line_error(proc)
    assert "does not exist" in line and str(missing) in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resume_never_and_auto_decide_on_complete_checkpoints(references, tmp_path, monkeypatch):
    from trainer.errors import UserError
    from trainer.preflight.rundir import check_run_dir

    run_dir = tmp_path / "run"
    ckpt = copy_run(references("none"), run_dir)
    check_run_dir(run_dir, "auto")  # continues it
    with pytest.raises(UserError, match="resume=never"):
        check_run_dir(run_dir, "never")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    check_run_dir(run_dir, "never")  # a restarted attempt of the same job continues its own run
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    (ckpt / MARKER).unlink()  # only an interrupted save left: nothing to resume, metrics.jsonl is there
    with pytest.raises(UserError, match="no complete checkpoint"):
        check_run_dir(run_dir, "auto")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _make_immutable(path: Path, on: bool) -> bool:
    if not shutil.which("chattr"):
        return False
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


def _assert_intact(run_dir: Path, ckpt: Path, reference: Path) -> None:
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [ckpt.name]  # the failed save cleaned up
    validate_checkpoint(ckpt)
    assert same_weights(run_dir, reference)


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_checkpoint(data_dir, references, tmp_path):
    reference = references("none")
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    size = sum(p.stat().st_size for p in latest_checkpoint(reference).iterdir())
    # A file system with room for the checkpoint resumed from and half of the next one.
    if not _mount_tmpfs(ckpts, str(int(size * 1.5))):
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN) to fill a disk")
    try:
        ckpt = copy_run(reference, run_dir)
        proc = run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, "train.max_steps=9", f"resume={ckpt}"))
        line = one_line_error(proc)
        # caught before the step is trained (tests/faults/test_disk_space.py: stopping after a save)
        assert "not enough free space for the next checkpoint" in line and "at the start" in line, line
        assert f"the newest checkpoint {ckpt} is intact" in line and "more bytes there" in line, line
        assert max(r["step"] for r in read_metrics(run_dir)) == STEPS, "trained a step it could not save"
        _assert_intact(run_dir, ckpt, reference)
    finally:
        subprocess.run(["umount", str(ckpts)], capture_output=True)


def test_unwritable_checkpoint_dir_keeps_the_previous_checkpoint(data_dir, references, tmp_path):
    """A permission error while saving (an immutable checkpoints/ folder: root ignores plain
    permissions), through the real Run and Checkpointer in this process."""
    from trainer.checkpoint.manager import Checkpointer
    from trainer.config.compose import compose
    from trainer.fit.run import Run
    from trainer.process.runtime import Runtime

    reference = references("none")
    run_dir = tmp_path / "run"
    ckpt = copy_run(reference, run_dir)
    overrides = tiny_args(data_dir, run_dir, *CKPT_ARGS, "train.max_steps=9", "train.device=cpu")[1:]
    cfg = compose([o for o in overrides if not o.startswith("hydra.")])
    rt = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)
    run = Run(cfg, rt, run_dir)
    checkpointer = Checkpointer(cfg, rt, run_dir)
    checkpointer.restore(run)
    assert run.state.step == STEPS
    if not _make_immutable(run_dir / "checkpoints", True):
        pytest.skip("chattr +i is not available on this file system")
    try:
        run.state.step += 1
        with pytest.raises(CheckpointError) as info:
            checkpointer.save(run)
    finally:
        _make_immutable(run_dir / "checkpoints", False)
    message = str(info.value)
    assert f"could not save checkpoint {NEXT}" in message, message
    assert "Operation not permitted" in message, message
    assert f"the previous checkpoint {ckpt} is intact" in message and "\n" not in message
    _assert_intact(run_dir, ckpt, reference)


# --- in-process: the checkpoint files themselves ------------------------------------------------------
def test_checkpoint_layout_and_retention(references):
    reference = references("none")
    found = list_checkpoints(reference / "checkpoints")
    assert [p.name for p in found] == CKPT_NAMES
    ckpt = found[-1]
    assert is_complete(ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["tokens"] == STEPS * 4 * 64 * 2
    assert len(state["loaders"]) == len(state["rng"]) == 1
    assert set(state["rng"][0]) >= {"torch", "numpy", "python"}
    assert json.loads((ckpt / "config.json").read_text())["model"]["name"] == "tiny"
    assert not [p for p in (reference / "checkpoints").iterdir() if p.name.startswith(".")]


def test_metadata_unpickler_refuses_code(references, tmp_path):
    ckpt = tmp_path / "evil"
    shutil.copytree(latest_checkpoint(references("none")), ckpt)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="not allowed"):
        read_metadata(ckpt)
    with pytest.raises(CheckpointError):
        load_model_weights(model_from_run(references("none"))[0], ckpt)
    assert not marker.exists()


@pytest.mark.slow
def test_load_model_weights_from_sharded_checkpoints(references):
    """The FSDP (sharded) and DDP reference runs trained the same model: loading either into a
    plain GPT in this process gives the same weights (to float rounding)."""
    fsdp, _ = model_from_run(references("fsdp"))
    ddp, _ = model_from_run(references("ddp"))
    for (name, a), b in zip(fsdp.state_dict().items(), ddp.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name
    assert fsdp.lm_head.weight is fsdp.transformer.wte.weight  # the tie survives loading
    with pytest.raises(CheckpointError, match="no complete checkpoint at step 5"):
        model_from_run(references("ddp"), step=5)
