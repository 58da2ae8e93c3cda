"""A prepared dataset is known by its source, not by its folder's name (issue 45 finding 1): two
sources never share a folder, another data.source under a prepared data.name is refused by prepare
and by train (never swapped in silently), the same files changed on disk are refused by train and
prepared again by prepare, and data.name alone trains on the prepared data without its source."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.dtrain import corpus_text, run_dtrain
from helpers.errors import error_line
from helpers.hints import run_hint

from trainer.config.compose import compose
from trainer.config.dataset_names import TEXT_SOURCE_NEEDED, text_dataset_name
from trainer.data.layout import dataset_dir
from trainer.data.manifest import load_manifest, schema_problem
from trainer.errors import DataError
from trainer.preflight.checks import check_data
from trainer.prepare import pipeline as P

TRAIN = ["train", "model=tiny", "train.max_steps=1", "train.micro_batch_size=2", "train.seq_len=32",
         "train.val_tokens=64", "train.sample_tokens=0", "train.progress=false"]


def write_sources(root: Path) -> tuple[Path, Path]:
    """A.txt (English-like text) and code/*.py (three Python files): two corpora, as in the issue."""
    a = root / "A.txt"
    a.write_text(corpus_text()[:60_000])
    code = root / "code"
    code.mkdir()
    for i in range(3):
        (code / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(400)))
    return a, code


def prepare_args(data: Path, *keys: str) -> list[str]:
    return ["prepare", "data=text", f"data.dir={data}", *keys]


def train_args(data: Path, run: Path, *keys: str) -> list[str]:
    return [*TRAIN, "data=text", f"data.dir={data}", f"hydra.run.dir={run}", *keys]


def trains_on(args: list[str]) -> str:
    """The source of the dataset the run of `args` would train on, after the data checks a run
    makes before it starts (check_data: the dataset a run reads is dataset_dir's)."""
    cfg = compose(args[1:])
    check_data(cfg, world=1)
    return json.loads((dataset_dir(P.as_data_cfg(cfg.data)) / "manifest.json").read_text())["source"]


def test_two_sources_get_two_folders_and_a_run_reads_the_one_it_names(tmp_path):
    """The issue's case: `data=text data.source=A.txt`, then `data.source='code/*.py'`, both without
    data.name, landed in one `text/` folder, the second replacing the first, and a run with
    data.source=A.txt trained on the code."""
    a, code = write_sources(tmp_path)
    data = tmp_path / "data"
    run_dtrain(prepare_args(data, f"data.source={a}"), check=True)
    a_manifest = next(data.iterdir()) / "manifest.json"
    written = a_manifest.read_bytes()
    run_dtrain(prepare_args(data, f"data.source={code}/*.py"), cwd=tmp_path, check=True)
    folders = sorted(p.name for p in data.iterdir())
    assert folders == sorted([text_dataset_name(str(a)), text_dataset_name(f"{code}/*.py")]), folders
    assert folders[0].startswith("A-") and folders[1].startswith("code-")
    assert a_manifest.read_bytes() == written  # A's dataset is as it was
    assert trains_on(train_args(data, tmp_path / "run", f"data.source={a}")) == str(a)
    assert trains_on(train_args(data, tmp_path / "run", f"data.source={code}/*.py")) == f"{code}/*.py"


def test_the_derived_name_is_readable_and_one_per_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {text_dataset_name(s) for s in ("A.txt", "code/*.py", "code", "notes/a.txt", "other/A.txt")}
    assert len(names) == 5 and text_dataset_name(None) == "text"
    assert text_dataset_name("A.txt") == text_dataset_name(str(tmp_path / "A.txt"))  # taken absolute
    assert text_dataset_name("code/*.py").startswith("code-") and text_dataset_name("notes/a.txt").startswith("a-")
    assert compose(["data=text", "data.source=A.txt"]).data.name == text_dataset_name("A.txt")
    assert compose(["data=text", "data.source=A.txt", "data.name=mine"]).data.name == "mine"


def test_prepare_refuses_another_source_under_a_prepared_name(tmp_path):
    """`prepare data.source=A.txt data.name=x`, then `data.source='code/*.py' data.name=x`: one line
    naming both, x as it was; the line's `--force` prepares x anew from the code."""
    a, code = write_sources(tmp_path)
    data = tmp_path / "data"
    run_dtrain(prepare_args(data, f"data.source={a}", "data.name=x"), check=True)
    manifest = data / "x" / "manifest.json"
    written = manifest.read_bytes()
    line = error_line(run_dtrain(prepare_args(data, "data.source=code/*.py", "data.name=x"), cwd=tmp_path))
    assert f"was prepared from data.source={a}, not data.source={code}/*.py" in line, line
    assert "data.name of its own" in line and "drop data.source" in line and line.endswith("--force`"), line
    assert manifest.read_bytes() == written
    run_hint(line, cwd=tmp_path)
    assert json.loads(manifest.read_text())["source"] == f"{code}/*.py"


def test_train_refuses_another_source_than_the_prepared_one(tmp_path):
    """x prepared from the code, then `train data.name=x data.source=A.txt` (data=text has no
    auto_prepare): one line naming both, no run directory; its `--force` hint prepares x from A.txt,
    on which the same command then trains."""
    a, code = write_sources(tmp_path)
    data, run = tmp_path / "data", tmp_path / "run"
    run_dtrain(prepare_args(data, f"data.source={code}/*.py", "data.name=x"), check=True)
    args = train_args(data, run, "data.name=x", f"data.source={a}")
    line = error_line(run_dtrain(args))
    assert f"was prepared from data.source={code}/*.py, not data.source={a}" in line, line
    assert not run.exists()
    assert trains_on(train_args(data, run, "data.name=x")) == f"{code}/*.py"  # data.name alone: the prepared x
    run_hint(line)
    assert trains_on(args) == str(a)


def test_changed_files_are_refused_by_train_and_prepared_again_by_prepare(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    text = corpus_text()
    (notes / "n1.txt").write_text(text[:30_000])
    (notes / "n2.txt").write_text(text[30_000:60_000])
    data, run = tmp_path / "data", tmp_path / "run"
    prepare = prepare_args(data, f"data.source={notes}", "data.name=notes")
    run_dtrain(prepare, check=True)
    (notes / "n3.txt").write_text(text[60_000:90_000])  # a file added to the folder
    with (notes / "n1.txt").open("a") as f:  # and one grown
        f.write("One line more.\n")
    args = train_args(data, run, "data.name=notes", f"data.source={notes}")
    line = error_line(run_dtrain(args))
    assert f"data.source={notes} changed on disk since dataset 'notes' was prepared from it" in line, line
    assert f"{notes / 'n3.txt'} added" in line and f"{notes / 'n1.txt'} 30,000 bytes then, 30,015 now" in line
    assert line.endswith("or drop data.source to train on the data as prepared") and "--force`" in line
    assert not run.exists()
    assert trains_on(train_args(data, run, "data.name=notes")) == str(notes)  # the files are not looked at
    run_hint(line)
    assert json.loads((data / "notes" / "manifest.json").read_text())["documents"] == 3
    trains_on(args)
    # prepare (without --force) of the same source, updated again: prepared again, saying why
    (notes / "n2.txt").unlink()
    again = run_dtrain(prepare, check=True)
    assert f"{notes / 'n2.txt'} removed): preparing it again" in again.stderr and "prepared notes" in again.stdout
    assert json.loads((data / "notes" / "manifest.json").read_text())["documents"] == 2


def test_a_continuing_run_reads_its_data_as_prepared_though_the_files_changed(tmp_path):
    """With data.auto_prepare: a run that starts afresh is refused when data.source changed on disk
    since it was prepared; a run that continues from its checkpoint reads the data as prepared (its
    checkpoint's data identity is what a continuation checks), which is not prepared again under it."""
    notes = tmp_path / "notes.txt"
    notes.write_text(corpus_text()[:40_000])
    data = tmp_path / "data"
    cfg = compose(train_args(data, tmp_path / "run", "data.name=notes", f"data.source={notes}",
                             "data.auto_prepare=true")[1:])
    check_data(cfg, world=1)  # prepares it
    manifest = data / "notes" / "manifest.json"
    written = manifest.read_bytes()
    with notes.open("a") as f:
        f.write("One line more.\n")
    with pytest.raises(DataError, match="changed on disk since dataset 'notes' was prepared from it"):
        check_data(cfg, world=1)
    check_data(cfg, world=1, continues=True)
    assert manifest.read_bytes() == written


def test_a_file_edited_in_place_to_the_same_size_is_a_change(tmp_path):
    """A fixed typo keeps a file's size: its modification time alone shows the edit, and a run
    that would train on the old tokens is refused, naming the file."""
    notes = tmp_path / "notes.txt"
    text = corpus_text()[:40_000]
    notes.write_text(text)
    cfg = compose(train_args(tmp_path / "data", tmp_path / "run", "data.name=notes", f"data.source={notes}",
                             "data.auto_prepare=true")[1:])
    check_data(cfg, world=1)  # prepares it
    before = notes.stat()
    notes.write_text(text.replace("the", "teh", 1))
    os.utime(notes, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))  # a later save, whatever the clock
    assert notes.stat().st_size == before.st_size
    with pytest.raises(DataError, match=f"changed on disk since dataset 'notes' was prepared from it.*{notes} modified "
                                        r"\d{4}-\d\d-\d\d .*\(same size\)"):
        check_data(cfg, world=1)


def test_data_name_alone_needs_no_source_and_data_text_alone_is_one_line(tmp_path):
    a, _ = write_sources(tmp_path)
    data, run = tmp_path / "data", tmp_path / "run"
    run_dtrain(prepare_args(data, f"data.source={a}", "data.name=x"), check=True)
    a.unlink()  # the raw text is gone: the prepared data still trains, and prepares as it is
    assert trains_on(train_args(data, run, "data.name=x")) == str(a)
    assert P.is_prepared(compose(["data=text", "data.name=x", f"data.dir={data}"]).data)
    for args in (train_args(data, run), prepare_args(data)):
        assert error_line(run_dtrain(args)).endswith(TEXT_SOURCE_NEEDED)
    assert not run.exists() and sorted(p.name for p in data.iterdir()) == ["x"]


def test_a_manifest_of_an_older_dtrain_still_loads(tmp_path):
    """A manifest without source_identity (written before it) is valid, prepared and trains, with
    its data.source too (nothing recorded to compare the files with); a malformed one is named."""
    a, _ = write_sources(tmp_path)
    data = tmp_path / "data"
    cfg = P.as_data_cfg({"name": "x", "dir": str(data), "source": str(a), "val_fraction": 0.1})
    path = P.prepare(cfg)
    manifest = json.loads(path.read_text())
    assert manifest["source_identity"]["kind"] == "files"
    assert [f["path"] for f in manifest["source_identity"]["files"]] == [str(a)]
    for bad in ({"kind": "files", "files": [{"path": str(a), "size": "1"}]}, {"kind": "ftp"}, []):
        assert "'source_identity'" in schema_problem({**manifest, "source_identity": bad})
    del manifest["source_identity"]
    path.write_text(json.dumps(manifest))
    assert load_manifest(path) is not None and P.is_prepared(cfg)
    a.write_text("other text\n")
    assert trains_on(train_args(data, tmp_path / "run", "data.name=x", f"data.source={a}",
                                "data.val_fraction=0.1")) == str(a)
