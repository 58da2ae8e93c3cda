"""Where `dtrain export`, `report` and `eval` write, refused in one line before any work when it
cannot or should not take their files: an empty --out (the current folder), the run directory itself
or a checkpoint folder, a file, a read-only mount (a real one: tests run as root, whom chmod does not
stop) and a disk without room. Each refusal writes nothing; where the run's own folder is the one
refused, the line names the --out that puts the results elsewhere, and that works."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.checkpoints import checkpointed_tiny_run, snapshot
from helpers.dtrain import run_dtrain
from helpers.evals import offline_env

from trainer.checkpoint.layout import latest_checkpoint
from trainer.cli import main
from trainer.config.schema import to_dict
from trainer.preflight.rundir import write_config_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(module_tmp) -> Path:
    """A tiny run directory as training leaves it: its resolved config, metrics lines and a
    checkpoint of two AdamW steps written by the real Checkpointer; plus a HellaSwag-format file."""
    run_dir = module_tmp.mktemp("outputs") / "run"
    cfg, _ = checkpointed_tiny_run(run_dir, ["train.seq_len=32"], steps=2, tokens_per_step=32)
    write_config_record(run_dir, to_dict(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "tokens": 32 * s, "loss": 11.0 - s, "lr": 1e-4 * s, "tokens_per_s": 900.0 + s}) + "\n"
        for s in (1, 2)))
    examples = [{"ctx": "the king hath", "endings": ["spoken", "bread", "rome", "wine"], "label": i % 4}
                for i in range(4)]
    (run_dir.parent / "hellaswag.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    return run_dir


def _mount(args: list[str]) -> str | None:
    """None when the mount worked, else why not."""
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


@pytest.fixture
def mounts(tmp_path):
    """read_only(folder): a read-only bind mount of `folder` (its source stays writable, so what
    a command wrote through the mount would show there); small_disk(bytes): a tmpfs of that size.
    Unmounted at the end; skipped, saying why, where mounting is not allowed."""
    made: list[Path] = []

    def read_only(folder: Path) -> Path:
        where = tmp_path / f"ro{len(made)}"
        where.mkdir()
        problem = _mount(["--bind", str(folder), str(where)])
        if problem:
            pytest.skip(f"cannot bind-mount here ({problem}): needs root")
        made.append(where)
        problem = _mount(["-o", "remount,bind,ro", str(where)])
        if problem or os.access(where, os.W_OK):
            pytest.skip(f"cannot make a read-only mount here ({problem or 'it stayed writable'})")
        return where

    def small_disk(size: int) -> Path:
        where = tmp_path / f"disk{len(made)}"
        where.mkdir()
        problem = _mount(["-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
        if problem:
            pytest.skip(f"cannot mount a small tmpfs here ({problem}): needs root")
        made.append(where)
        return where

    yield SimpleNamespace(read_only=read_only, small_disk=small_disk)
    for where in reversed(made):
        subprocess.run(["umount", "-l", str(where)], check=False)


def one_line(argv: list[str], capsys) -> str:
    """The error of `dtrain ARGV` run in this process: exit code 2, one `error:` line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    assert exit_info.value.code == 2, out.out + out.err
    assert out.err.startswith("error:") and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
    return " ".join(out.err.split())


# --- export -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("out, needle", [
    ("", "an empty folder name would write into the current folder"),
    ("RUN", "is the run directory itself"),
    ("RUN/checkpoints", "is in the checkpoint folder RUN/checkpoints"),
    ("RUN/checkpoints/step_000002/hf", "is in the checkpoint folder RUN/checkpoints/step_000002"),
])
def test_export_refuses_the_current_folder_the_run_dir_and_checkpoints(run_dir, out, needle, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = snapshot(run_dir)
    err = one_line(["export", str(run_dir), "--out", out.replace("RUN", str(run_dir))], capsys)
    assert needle.replace("RUN", str(run_dir)) in err and "--out DIR" in err, err
    assert snapshot(run_dir) == before and list(tmp_path.iterdir()) == []


def test_export_of_a_checkpoint_folder_refuses_the_default_inside_it(run_dir, capsys):
    ckpt = latest_checkpoint(run_dir)
    before = snapshot(run_dir)
    err = one_line(["export", str(ckpt)], capsys)
    assert f"the default output folder {ckpt / 'export'}" in err and f"checkpoint folder {ckpt}," in err, err
    assert "choose another --out DIR" in err and snapshot(run_dir) == before


def test_export_onto_a_disk_without_room_for_the_weights_is_refused_before_writing(run_dir, mounts, capsys):
    """13 MB of float32 weights, 4 MB of disk: the line comes from the sizes, before the first byte
    (a write that fails says 'no space left ... (FILE)' instead)."""
    disk = mounts.small_disk(4 << 20)
    err = one_line(["export", str(run_dir), "--out", str(disk / "hf")], capsys)
    needed, free = (int(n.replace(",", "")) for n in err.split("it needs ")[1].split(" are free")[0].split(" bytes, "))
    assert f"no space left on the disk holding {disk / 'hf'} for the export" in err, err
    assert needed > 13_000_000 > free and "choose another --out DIR" in err, err
    assert list(disk.iterdir()) == []


# --- report -----------------------------------------------------------------------------------------
def test_report_refuses_an_empty_out_and_a_file(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = one_line(["report", str(run_dir), "--out", ""], capsys)
    assert "an empty folder name would write into the current folder" in err, err
    assert list(tmp_path.iterdir()) == []  # no PNG in the current folder
    target = tmp_path / "figures.png"
    target.write_bytes(b"mine")
    err = one_line(["report", str(run_dir), "--out", str(target)], capsys)
    assert f"--out {target}: {target} is a file, not a folder; choose another --out DIR" in err, err
    assert target.read_bytes() == b"mine" and list(tmp_path.iterdir()) == [target]


def test_report_of_a_run_on_a_read_only_mount(run_dir, mounts, tmp_path, capsys):
    """Its figures' default folder is the run's: one line naming it and --out; with --out they go there."""
    pytest.importorskip("matplotlib")
    before = snapshot(run_dir)
    frozen = mounts.read_only(run_dir)
    err = one_line(["report", str(frozen)], capsys)
    assert f"the folder {frozen} cannot be written (a read-only file system)" in err, err
    assert "write them elsewhere with --out DIR" in err, err
    main(["report", str(frozen), "--out", str(tmp_path / "figures")])
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {"loss.png", "lr.png", "tokens_per_s.png",
                                                                  "report.json"}  # issue 37: beside the figures
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in (tmp_path / "figures").glob("*.png"))
    assert snapshot(run_dir) == before


def test_report_onto_a_full_disk_is_one_line(run_dir, mounts, capsys):
    pytest.importorskip("matplotlib")
    disk = mounts.small_disk(256 << 10)
    err = one_line(["report", str(run_dir), "--out", str(disk / "figures")], capsys)
    assert f"the disk holding {disk} is full" in err and "choose another --out DIR" in err, err
    assert list(disk.iterdir()) == []


# --- eval -------------------------------------------------------------------------------------------
def test_eval_of_a_run_on_a_read_only_mount(run_dir, mounts, tmp_path, capsys):
    """HellaSwag's result goes into the run directory: read-only, one line naming it and --out before
    the weights are read; with --out the result is written there."""
    before = snapshot(run_dir)
    frozen = mounts.read_only(run_dir)
    data = f"eval.hellaswag.path={run_dir.parent / 'hellaswag.jsonl'}"
    err = one_line(["eval", str(frozen), data], capsys)
    assert f"the run directory {frozen} (where the results go without --out)" in err, err
    assert "a read-only file system" in err and "write them elsewhere with --out DIR" in err, err
    main(["eval", str(frozen), data, "--out", str(tmp_path / "results")])
    result = json.loads((tmp_path / "results" / "eval_hellaswag.json").read_text())
    assert result["hellaswag_n"] == 4 and result["step"] == 2
    assert snapshot(run_dir) == before


def test_eval_tasks_of_a_run_on_a_read_only_mount_names_out(run_dir, mounts, capsys):
    pytest.importorskip("lm_eval")
    frozen = mounts.read_only(run_dir)
    err = one_line(["eval", str(frozen), "--tasks", "arc_easy", "--device", "cpu"], capsys)
    assert f"the run directory {frozen} (where the results go without --out)" in err, err
    assert "a read-only file system" in err and "write them elsewhere with --out DIR" in err, err


@pytest.mark.parametrize("out, needle", [
    ("", "an empty folder name would write into the current folder"),
    ("DISK/results", "the disk holding DISK is full"),
])
def test_eval_refuses_an_empty_out_and_a_full_disk(run_dir, out, needle, mounts, tmp_path, monkeypatch, capsys):
    disk = mounts.small_disk(256 << 10)
    monkeypatch.chdir(tmp_path)
    data = f"eval.hellaswag.path={run_dir.parent / 'hellaswag.jsonl'}"
    before = snapshot(run_dir)
    err = one_line(["eval", str(run_dir), data, "--out", out.replace("DISK", str(disk))], capsys)
    assert needle.replace("DISK", str(disk)) in err, err
    assert snapshot(run_dir) == before and list(disk.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == [disk.name]


@pytest.mark.slow
def test_eval_tasks_with_out_scores_a_run_on_a_read_only_mount(harness_run, harness_tasks, mounts, tmp_path):
    """The harness's results and per-request records go to --out; the read-only run is untouched."""
    pytest.importorskip("lm_eval")
    before = snapshot(harness_run)
    frozen = mounts.read_only(harness_run)
    out = tmp_path / "scores"
    proc = run_dtrain(["eval", str(frozen), "--tasks", "dtrain_mc", "--include-path", str(harness_tasks),
                       "--limit", "4", "--device", "cpu", "--log-samples", "--out", str(out)], env=offline_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / "eval_harness.json").read_text())
    assert record["run_dir"] == str(frozen) and "dtrain_mc" in record["results"]
    assert len((out / "eval_samples_dtrain_mc.jsonl").read_text().splitlines()) == 4
    assert snapshot(harness_run) == before
