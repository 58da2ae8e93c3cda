"""data=hf (issue 36 item 6): any Hugging Face dataset, or local parquet / jsonl / json / txt files,
each record's data.text_field; fineweb_edu is its preset, its prepared folders as valid as before.
No network: local files, the real `datasets` library on a local folder, and the Hub offline."""

from __future__ import annotations

import gzip
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.dtrain import corpus_text, dtrain_env, read_metrics, run_dtrain, tiny_args

from trainer.config.compose import compose
from trainer.config.dataset_names import hf_dataset_name
from trainer.config.validation import check_dataset_name
from trainer.data.identity import data_identity
from trainer.errors import ConfigError, DataError
from trainer.fetch.hub import OFFLINE_VARS, PROXY_VARS
from trainer.preflight.checks import check_data
from trainer.prepare import documents
from trainer.prepare import pipeline as P
from trainer.tokenizers.gpt2 import EOT, gpt2_encoding


def hf(*keys: str):
    """data=hf as `dtrain prepare` composes it, with `key=value` overrides of data.* (one tokenizing
    process: these corpora are small)."""
    return compose(["data=hf", "data.num_proc=1", *(f"data.{k}" for k in keys)]).data


def stories(n: int = 40) -> list[str]:
    return [f"Story {i}: the fox read {i % 7} books by the river. " * (i % 3 + 1) for i in range(n)]


def parquet_folder(root: Path, docs: list[str], column: str = "story") -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = root / "stories"
    folder.mkdir(parents=True)
    half = len(docs) // 2  # two files, read in name order
    for name, part in (("part-0.parquet", docs[:half]), ("part-1.parquet", docs[half:])):
        pq.write_table(pa.table({column: part, "id": list(range(len(part)))}), folder / name)
    return folder


def prepared_stream(cfg) -> tuple[dict, list[int]]:
    manifest = json.loads(P.prepare(cfg, progress=False).read_text())
    root = P.dataset_dir(P.as_data_cfg(cfg))
    entries = manifest["splits"]["train"] + manifest["splits"]["val"]
    return manifest, np.concatenate([np.fromfile(root / e["file"], dtype="<u2") for e in entries]).tolist()


def encoded(docs: list[str]) -> list[int]:
    enc = gpt2_encoding()
    return [t for d in docs for t in [EOT] + enc.encode_ordinary(d)]


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines and lines[-1].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


# ---------------------------------------------------------------------------------- local files


def test_local_parquet_folder_jsonl_and_glob_read_their_text_field(tmp_path):
    docs = stories()
    folder = parquet_folder(tmp_path, docs)
    cfg = hf(f"hf_path={folder}", "text_field=story", f"dir={tmp_path / 'data'}", "val_fraction=0.1")
    manifest, stream = prepared_stream(cfg)
    assert stream == encoded(docs) and manifest["documents"] == len(docs)
    assert manifest["settings"]["hf_path"] == str(folder) and manifest["settings"]["text_field"] == "story"
    assert manifest["dataset"] == cfg.name == P.dataset_dir(cfg).name and cfg.name.startswith("stories-train-story-")
    # the same records as JSON lines (gzipped), as one JSON array, and through a glob
    lines = tmp_path / "jl" / "a.jsonl.gz"
    lines.parent.mkdir()
    with gzip.open(lines, "wt") as f:
        f.writelines(json.dumps({"story": d, "n": 1}) + "\n" for d in docs[:20])
    (tmp_path / "jl" / "b.json").write_text(json.dumps([{"story": d} for d in docs[20:]]))
    glob_cfg = hf(f"hf_path={tmp_path}/jl/*", "text_field=story", f"dir={tmp_path / 'data'}", "val_fraction=0.1")
    assert glob_cfg.name != cfg.name and glob_cfg.name.startswith("jl-train-story-")
    assert prepared_stream(glob_cfg)[1] == encoded(docs)
    # .txt files are one document each, whatever the field
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "one.txt").write_text("plain text, one document\n")
    assert prepared_stream(hf(f"hf_path={tmp_path}/txt", f"dir={tmp_path / 'data'}"))[1] == encoded(
        ["plain text, one document\n"])


def test_a_folder_name_per_dataset_and_the_same_one_again(tmp_path, monkeypatch):
    base = ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text")
    variants = [base, ("other/fineweb-edu", *base[1:]), (base[0], None, "train", "text"),
                (base[0], base[1], "test", "text"), (*base[:3], "content"), (str(tmp_path), None, "train", "text")]
    names = [hf_dataset_name(*v) for v in variants]
    assert len(set(names)) == len(names), names
    assert names[0].startswith("fineweb-edu-sample-10BT-train-") and "-content-" in names[4]
    assert all("/" not in n and not n.startswith(".") for n in names)
    # a local path names the same folder whichever way it is written; data.name names it yourself
    monkeypatch.chdir(tmp_path.parent)
    assert hf_dataset_name(f"./{tmp_path.name}", None, "train", "text") == names[5]
    assert hf(f"hf_path={tmp_path}", "name=mine").name == "mine"
    check_dataset_name(hf("name=mine"))  # training on a dataset prepared as `mine` needs no hf_path


def test_fineweb_edu_is_a_preset_of_hf_with_the_same_settings_and_folder(tmp_path):
    """The values, settings (what decides whether a prepared folder is up to date), folder, prepare
    command and data identity that data=fineweb_edu had before it became a preset of data=hf."""
    data = compose(["data=fineweb_edu", f"data.dir={tmp_path}"]).data
    before = {"name": "fineweb_edu", "source": None, "sha256": None, "val_fraction": 0.01, "shard_tokens": 100_000_000,
              "hf_path": "HuggingFaceFW/fineweb-edu", "hf_name": "sample-10BT", "hf_split": "train", "max_tokens": None,
              "verify": "auto", "num_proc": None, "auto_prepare": False}
    assert {k: data[k] for k in before} == before and data.text_field == "text"
    settings = {k: before[k] for k in ("source", "sha256", "val_fraction", "shard_tokens", "max_tokens", "hf_path",
                                       "hf_name", "hf_split")}
    assert P.settings_of(data) == settings  # no text_field key: manifests written before stay up to date
    assert P.dataset_dir(data) == tmp_path / "fineweb_edu"
    assert P.prepare_command(data) == f"dtrain prepare data=fineweb_edu data.dir={tmp_path}"
    # A folder prepared from local files, its manifest as the dtrain before data=hf wrote it: up to
    # date (not prepared again), and its identity is that of its shards.
    rows = tmp_path / "fw.jsonl"
    rows.write_text("".join(json.dumps({"text": d}) + "\n" for d in stories()))
    local = compose(["data=fineweb_edu", f"data.dir={tmp_path}", f"data.source={rows}", "data.val_fraction=0.1"]).data
    path = P.prepare(local, progress=False)
    manifest = json.loads(path.read_text())
    assert manifest["settings"] == {**settings, "source": str(rows), "val_fraction": 0.1}
    assert manifest["source"] == str(rows) and manifest["dataset"] == "fineweb_edu"
    written = path.stat().st_mtime_ns
    assert P.is_prepared(local) and P.prepare(local) == path and path.stat().st_mtime_ns == written
    identity = data_identity(local)
    assert identity["train"]["tokens"] + identity["val"]["tokens"] == len(encoded(stories()))


# ------------------------------------------------------------------------------- one-line errors


def test_a_missing_text_field_names_the_fields_there_are(tmp_path):
    folder = parquet_folder(tmp_path, stories(), column="content")
    proc = run_dtrain(["prepare", "data=hf", f"data.hf_path={folder}", f"data.dir={tmp_path / 'data'}"])
    line = one_error_line(proc)
    assert "has no 'text' field (its fields: content, id)" in line and "data.text_field" in line
    assert not (tmp_path / "data").exists()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "a", "url": "u"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:1 has no 'text' field \(its fields: body, url\)"):
        P.prepare(hf(f"hf_path={rows}", f"dir={tmp_path / 'data'}"))
    rows.write_text('{"text": ["not", "a", "string"]}\n')
    with pytest.raises(DataError, match="holds list, not text"):
        P.prepare(hf(f"hf_path={rows}", f"dir={tmp_path / 'data'}"))
    assert not (tmp_path / "data").exists()


def test_data_hf_without_hf_path_is_one_line_for_prepare_and_train(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a record"}\n')
    for source in ([], [f"source={rows}"]):  # data.source replaces a preset's Hub; data=hf reads data.hf_path
        with pytest.raises(ConfigError, match="data=hf needs data.hf_path"):
            P.prepare(hf(f"dir={tmp_path / 'data'}", *source))
    proc = run_dtrain(["train", "data=hf", f"data.dir={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "data=hf needs data.hf_path" in one_error_line(proc)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_local_files_that_do_not_exist_and_hub_keys_on_local_files(tmp_path):
    for path, needle in ((f"{tmp_path}/nope", "does not exist"), (f"{tmp_path}/*.parquet", "matches no files")):
        with pytest.raises(DataError, match=re.escape(f"data.hf_path={path} {needle}")):
            P.prepare(hf(f"hf_path={path}", f"dir={tmp_path / 'data'}"))
    (tmp_path / "a.txt").write_text("x\n")
    for key in ("hf_name=en", "hf_split=test"):
        with pytest.raises(DataError, match=f"data.{key} selects within a Hub dataset"):
            P.prepare(hf(f"hf_path={tmp_path}/a.txt", key, f"dir={tmp_path / 'data'}"))
    assert not (tmp_path / "data").exists()


def test_the_hub_without_datasets_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataError, match=r"pip install 'dtrain\[fineweb\]'"):
        P.prepare(hf("hf_path=roneneldan/TinyStories", f"dir={tmp_path / 'data'}"))
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # imports `datasets` (seconds)
@pytest.mark.parametrize("offline, hint", [
    ({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hub is out of reach (127.0.0.1:9 does not answer"),  # nothing listens
], ids=["offline mode set", "no answer"])
def test_an_unreachable_hub_is_one_line_without_the_clients_retries(offline, hint, tmp_path):
    pytest.importorskip("datasets")
    env = dtrain_env()
    for var in (*OFFLINE_VARS, *PROXY_VARS):
        env.pop(var, None)
    env.update(offline, HF_HOME=str(tmp_path / "hf_home"))
    start = time.monotonic()
    proc = run_dtrain(["prepare", "data=hf", "data.hf_path=dtrain-tests/no-such-dataset",
                       f"data.dir={tmp_path / 'data'}"], env=env, timeout=120)
    took = time.monotonic() - start
    line = one_error_line(proc)
    assert "cannot stream dtrain-tests/no-such-dataset split train from Hugging Face" in line
    assert hint in line and "data.hf_path=DIR" in line
    assert "Retrying" not in proc.stderr
    assert took < 20, f"{took:.0f} s: the Hub's clients retried instead of failing at once"  # retrying adds ~23 s
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # imports `datasets` (seconds)
def test_the_datasets_stream_on_a_local_dataset(tmp_path, monkeypatch):
    """The Hub reader through the real `datasets` library, on a local dataset folder: the same
    documents as dtrain's own parquet reader; a missing field and an unknown split, one line each."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = stories()
    folder = str(parquet_folder(tmp_path, docs))
    assert list(documents.hub_documents(folder, None, "train", "story")) == docs
    with pytest.raises(DataError, match=r"row 0 has no 'text' field \(its fields: story, id\)"):
        documents.check_hub(folder, None, "train", "text")
    with pytest.raises(DataError, match=f"cannot stream {folder} split test from Hugging Face .*Bad split"):
        documents.check_hub(folder, None, "test", "story")


# ------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_prepare_data_hf_then_train_on_it(tmp_path):
    pytest.importorskip("pyarrow")
    text = corpus_text()
    docs = [text[i:i + 4000] for i in range(0, 200_000, 4000)]  # ~50k tokens: steps and validation
    folder = parquet_folder(tmp_path, docs, column="content")
    data = [f"data.hf_path={folder}", "data.text_field=content", "data.val_fraction=0.1"]
    prepared = run_dtrain(["prepare", "data=hf", *data, f"data.dir={tmp_path / 'data'}"], check=True)
    (name,) = [p.name for p in (tmp_path / "data").iterdir()]
    assert f"prepared {name}:" in prepared.stdout and name.startswith("stories-train-content-")
    args = [a for a in tiny_args(tmp_path / "data", tmp_path / "run", "train.max_steps=4", "train.val_interval=4")
            if not a.startswith(("data=", "data.name="))]
    run_dtrain([*args, "data=hf", *data], check=True)
    config = json.loads((tmp_path / "run" / "resolved_config.json").read_text())
    assert config["data"]["name"] == name and config["data"]["text_field"] == "content"
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "loss" in m][-1] == 4 and any("val_loss" in m for m in metrics)



def test_another_text_field_under_a_prepared_name_is_refused(tmp_path):
    """Records with two text fields, prepared as data.name=x from one: the same records' other field
    under x is other text, refused in one line naming both (never trained on as the first field's tokens)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": d, "summary": d[:80]}) + "\n" for d in stories()))
    keys = ["model=tiny", "data=hf", f"data.dir={tmp_path / 'data'}", f"data.hf_path={rows}", "data.name=x",
            "data.auto_prepare=true", "data.val_fraction=0.1", "train.seq_len=32", "train.micro_batch_size=2",
            "train.val_tokens=64"]
    check_data(compose(keys), world=1)  # prepares x from the text field
    with pytest.raises(DataError, match=rf"dataset 'x' in .* was prepared from data.hf_path={rows}, not "
                                        rf"data.hf_path={rows} data.text_field=summary"):
        check_data(compose([*keys, "data.text_field=summary"]), world=1)
