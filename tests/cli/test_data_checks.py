"""A prepared dataset is checked before anything is written (issue 38): its manifest as a whole and its
tokenizer, ids within GPT-2's vocabulary, splits that hold one step, data.max_tokens, and a sweep's
data before its sweep folder. Each case ends with one `error:` line, exit code 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.dtrain import run_dtrain, tiny_args
from helpers.errors import error_line

from trainer.config.compose import compose
from trainer.data import shard_reader
from trainer.data.loader import ShardLoader
from trainer.data.manifest import TOP_LEVEL, load_manifest
from trainer.errors import DataError
from trainer.preflight.checks import check_data
from trainer.prepare import pipeline as P
from trainer.tokenizers.gpt2 import VOCAB_SIZE

TEXT = "".join(f"Line {i}: the quality of mercy is not strained.\n" for i in range(3000))


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: it damages, copies and re-tokenizes the
    GPT-2 shards and manifest."""
    return gpt2_data_dir


def copy_dataset(data_dir: Path, tmp_path: Path) -> Path:
    """A copy of the session's prepared `corpus` in a data.dir of its own; returns that data.dir."""
    root = tmp_path / "data"
    shutil.copytree(data_dir / "corpus", root / "corpus")
    return root


def manifest_path(root: Path) -> Path:
    return root / "corpus" / "manifest.json"


def edit_manifest(root: Path, edit) -> bytes:
    """Apply `edit` to the manifest (a dict) and write it back; returns the bytes written."""
    m = json.loads(manifest_path(root).read_text())
    edit(m)
    data = json.dumps(m, indent=2).encode()
    manifest_path(root).write_bytes(data)
    return data


def train_entry(m: dict) -> dict:
    return m["splits"]["train"][0]


def refused_run(root: Path, tmp_path: Path, *extra: str) -> str:
    """The error line of a tiny run on the dataset in `root`, asserting it wrote no run directory."""
    run = tmp_path / "run"
    line = error_line(run_dtrain(tiny_args(root, run, *extra)))
    assert not run.exists()
    return line


# ------------------------------------------------------------------------------------- manifest

DAMAGED = {
    "tokens a string": lambda m: train_entry(m).update(tokens=str(train_entry(m)["tokens"])),
    "entry without file": lambda m: train_entry(m).pop("file"),
    "split an object": lambda m: m["splits"].update(train=train_entry(m)),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_manifest_is_one_line_naming_it_and_prepare_force(case, data_dir, tmp_path):
    root = copy_dataset(data_dir, tmp_path)
    written = edit_manifest(root, DAMAGED[case])
    line = refused_run(root, tmp_path)
    assert str(manifest_path(root)) in line and "dtrain prepare data=text data.name=corpus" in line
    assert line.endswith("--force`"), line
    assert manifest_path(root).read_bytes() == written  # left as it was


def schema_cases(m: dict) -> dict:
    """name -> a manifest with one thing wrong, for every part of what prepare writes."""
    cases = {}

    def case(name, edit):
        broken = json.loads(json.dumps(m))
        edit(broken)
        cases[name] = broken

    for key in TOP_LEVEL:
        case(f"no {key}", lambda b, key=key: b.pop(key))
        if key not in ("format",):
            case(f"{key} of another type", lambda b, key=key: b.update({key: [] if key != "splits" else "train"}))
    case("format a boolean", lambda b: b.update(format=True))
    case("settings lack a key", lambda b: b["settings"].pop("val_fraction"))
    case("a list, not an object", lambda b: b.clear())
    case("val split an object", lambda b: b["splits"].update(val={"file": "val_000000.bin"}))
    case("entry a string", lambda b: b["splits"]["train"].__setitem__(0, "train_000000.bin"))
    for key in ("file", "tokens", "sha256"):
        case(f"entry without {key}", lambda b, key=key: train_entry(b).pop(key))
    for name, value in {"a path out of the folder": "../../outside.bin", "a folder path": "sub/train_000000.bin",
                        "a number": 7, "not a .bin": "train_000000.txt", "empty": ""}.items():
        case(f"file {name}", lambda b, value=value: train_entry(b).update(file=value))
    for name, value in {"negative": -2, "a boolean": True, "a fraction": 1.5, "null": None}.items():
        case(f"tokens {name}", lambda b, value=value: train_entry(b).update(tokens=value))
    case("sha256 not hex", lambda b: train_entry(b).update(sha256="z" * 64))
    case("sha256 short", lambda b: train_entry(b).update(sha256="ab"))
    case("tokens that do not add up", lambda b: b.update(tokens=b["tokens"] + 1))
    return cases


def test_every_part_of_the_manifest_schema_is_checked(data_dir, tmp_path):
    """Each way a manifest can differ from prepare's is one DataError line naming the file and
    `--force` (and the lenient reader behind is_prepared / data_identity sees no dataset)."""
    good = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    root = tmp_path / "data"
    (root / "corpus").mkdir(parents=True)
    cfg = P.as_data_cfg({"name": "corpus", "dir": str(root)})
    cases = schema_cases(good)
    assert len(cases) > 30
    for name, broken in cases.items():
        if name == "a list, not an object":
            broken = [broken]
        manifest_path(root).write_text(json.dumps(broken))
        with pytest.raises(DataError) as err:
            shard_reader.read_manifest(cfg)
        message = str(err.value)
        assert str(manifest_path(root)) in message and "--force" in message and "\n" not in message, name
        assert load_manifest(manifest_path(root)) is None, name
    manifest_path(root).write_text(json.dumps(good))
    assert shard_reader.read_manifest(cfg) == good  # the good one passes


# ------------------------------------------------------------------------------------ tokenizer


def as_llama(m: dict) -> None:
    m.update(tokenizer="llama", vocab_size=128256, eot=128001)


def test_a_manifest_of_another_tokenizer_is_refused_naming_both(data_dir, tmp_path):
    root = copy_dataset(data_dir, tmp_path)
    written = edit_manifest(root, as_llama)
    line = refused_run(root, tmp_path)
    assert str(manifest_path(root)) in line and "'llama' with 128,256 ids" in line
    assert f"'gpt2' with {VOCAB_SIZE:,} ids" in line and line.endswith("--force`"), line
    # auto_prepare does not overwrite it unasked either: the same line, the dataset as it was
    source = tmp_path / "corpus.txt"
    source.write_text(TEXT)
    line = refused_run(root, tmp_path, "data.auto_prepare=true", f"data.source={source}")
    assert "'llama'" in line and "--force" in line
    assert manifest_path(root).read_bytes() == written


def test_prepare_replaces_another_tokenizers_dataset_only_when_forced(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text(TEXT)
    cfg = P.as_data_cfg({"name": "text", "dir": str(tmp_path / "data"), "source": str(src)})
    path = P.prepare(cfg)
    m = json.loads(path.read_text())
    as_llama(m)
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match="'llama' with 128,256 ids.*--force"):
        P.prepare(cfg)
    assert not P.is_prepared(cfg)
    assert json.loads(P.prepare(cfg, force=True).read_text())["tokenizer"] == "gpt2"
    assert P.is_prepared(cfg)


# ------------------------------------------------------------------------------ ids in the vocabulary


def put_id(root: Path, position: int, token_id: int = 65535, update_sha256: bool = True) -> Path:
    """Write `token_id` at `position` of the train shard (its recorded sha256 updated: a shard
    that was written so, not damaged since)."""
    shard = root / "corpus" / "train_000000.bin"
    ids = np.memmap(shard, dtype="<u2", mode="r+")
    ids[position] = token_id
    ids.flush()
    del ids
    if update_sha256:
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        edit_manifest(root, lambda m: train_entry(m).update(sha256=digest))
    return shard


def test_ids_beyond_the_vocabulary_fail_where_verify_reads_the_data(data_dir, tmp_path):
    root = copy_dataset(data_dir, tmp_path)
    shard = put_id(root, 1000)
    cfg = P.as_data_cfg({"name": "corpus", "dir": str(root), "verify": "sha256"})
    with pytest.raises(DataError) as err:
        shard_reader.open_split(cfg, "train")
    message = str(err.value)
    assert f"shard {shard} holds token id 65,535" in message and f"{VOCAB_SIZE:,}" in message
    assert message.endswith("--force`") and "\n" not in message
    cfg.verify = "auto"  # a small split is read in full: the same
    with pytest.raises(DataError, match="65,535"):
        shard_reader.open_split(cfg, "train")
    cfg.verify = "size"  # not read up front: the loader checks each batch
    assert len(shard_reader.open_split(cfg, "train")) == 1
    put_id(root, 1000, VOCAB_SIZE - 1)  # the largest id GPT-2 has is fine
    cfg.verify = "sha256"
    assert len(shard_reader.open_split(cfg, "train")) == 1


def test_the_loader_refuses_a_batch_with_an_id_beyond_the_vocabulary(tmp_path):
    path = tmp_path / "train_000000.bin"
    ids = np.arange(2000, dtype="<u2")
    ids[700] = VOCAB_SIZE
    ids.tofile(path)
    shard = np.memmap(path, dtype="<u2", mode="r")
    loader = ShardLoader([shard], 2, 64, 0, 1, 1, 0, torch.device("cpu"), redo="run `dtrain prepare x --force`")
    for _ in range(5):  # batches 0..4 hold tokens 0..640: fine
        loader.next_batch()
    with pytest.raises(DataError) as err:
        loader.next_batch()  # tokens 640..769
    assert str(err.value).startswith(f"shard {path} holds token id {VOCAB_SIZE:,}")
    assert "run `dtrain prepare x --force`" in str(err.value) and "data.verify=sha256" in str(err.value)
    plain = ShardLoader([np.asarray(ids)], 2, 64, 0, 1, 1, 0, torch.device("cpu"), what="val split")
    for _ in range(5):
        plain.next_batch()
    with pytest.raises(DataError, match="shard #0 of the val split holds token id"):
        plain.next_batch()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_verify_size_meets_an_id_beyond_the_vocabulary_in_training_as_one_line(world, data_dir, tmp_path):
    """Not read up front, the id is met by the loader in training: one line from the worker that
    reads it (rank 1's first micro batch at world 2), no traceback."""
    root = copy_dataset(data_dir, tmp_path)
    shard = put_id(root, 256 + 100)  # the second micro batch of 4 x 64 tokens: rank 1's at world 2
    extra = ["parallel=ddp", "world=2"] if world == 2 else ["train.grad_accum_steps=2"]
    line = error_line(run_dtrain(tiny_args(root, tmp_path / "run", "data.verify=size", *extra)))
    assert f"shard {shard} holds token id 65,535" in line and "--force" in line


# ------------------------------------------------------------------------- splits that hold a step


def prepared(tmp_path: Path, **settings) -> Path:
    """A small `text` dataset named corpus prepared with `settings`; returns its data.dir."""
    src = tmp_path / "c.txt"
    src.write_text(TEXT)
    root = tmp_path / "data"
    P.prepare(P.as_data_cfg({"name": "corpus", "dir": str(root), "source": str(src), **settings}))
    return root


def test_a_val_split_smaller_than_one_sequence_is_refused_before_anything_is_written(tmp_path):
    root = prepared(tmp_path, val_fraction=0.001)
    line = refused_run(root, tmp_path, "data.val_fraction=0.001")
    assert "val split of dataset 'corpus' holds at most" in line
    assert "one validation sequence needs 65 (seq_len 64, +1)" in line
    assert "data.val_fraction" in line and "train.val_tokens=0" in line


def test_train_shards_smaller_than_one_step_are_refused_before_anything_is_written(tmp_path):
    root = prepared(tmp_path, shard_tokens=200)
    line = refused_run(root, tmp_path, "data.shard_tokens=200")
    assert "train split of dataset 'corpus' holds at most 200 tokens per shard" in line
    assert "data.shard_tokens" in line


# ------------------------------------------------------------------------------------ max_tokens


def test_max_tokens_too_small_names_the_key_and_a_value_that_works(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text(TEXT)
    root = tmp_path / "data"
    line = refused_run(root, tmp_path, "data.auto_prepare=true", f"data.source={src}", "data.max_tokens=1")
    assert line.startswith("error: data.max_tokens=1 leaves") and "has no text" not in line
    least = int(line.split("set data.max_tokens=")[1].split()[0])
    assert not root.exists()
    # that value fits one step and one validation sequence of the run; one less does not
    run = compose(tiny_args(root, tmp_path / "run", "data.auto_prepare=true", f"data.source={src}")[1:])
    run.data.max_tokens = least
    check_data(run, world=1)
    run.data.max_tokens = least - 1
    with pytest.raises(DataError, match=f"set data.max_tokens={least} or more"):
        check_data(run, world=1)
    # `dtrain prepare` alone: the key and the fewest tokens that hold any text
    proc = run_dtrain(["prepare", "data=text", "data.name=small", f"data.source={src}", f"data.dir={root}",
                       "data.max_tokens=1"])
    assert "data.max_tokens=1 keeps no text" in error_line(proc) and "data.max_tokens=2 or more" in proc.stderr
    assert not (root / "small").exists()


# ----------------------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize("data", [["data.name=missing"], ["data.name=missing", "data.auto_prepare=true"]])
def test_a_sweep_on_unprepared_data_writes_no_sweep_folder(data, data_dir, tmp_path):
    sweep = tmp_path / "sweep"
    args = [a for a in tiny_args(data_dir, tmp_path / "unused", *data) if not a.startswith("hydra.run.dir=")]
    proc = run_dtrain(["train", "-m", *args[1:], "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"])
    line = error_line(proc)
    assert "missing" in line and ("dtrain prepare" in line or "data.source" in line), line
    assert not sweep.exists() and not (data_dir / "missing").exists()


def test_a_sweep_over_another_tokenizers_dataset_writes_no_sweep_folder(data_dir, tmp_path):
    """Its points would prepare the data when they start (data.auto_prepare): the dataset in the way
    is refused up front all the same, and left as it was."""
    root = copy_dataset(data_dir, tmp_path)
    written = edit_manifest(root, as_llama)
    source = tmp_path / "corpus.txt"
    source.write_text(TEXT)
    sweep = tmp_path / "sweep"
    args = [a for a in tiny_args(root, tmp_path / "unused") if not a.startswith("hydra.run.dir=")]
    proc = run_dtrain(["train", "-m", *args[1:], "data.auto_prepare=true", f"data.source={source}",
                       "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"])
    assert "'llama' with 128,256 ids" in error_line(proc)
    assert not sweep.exists() and manifest_path(root).read_bytes() == written
