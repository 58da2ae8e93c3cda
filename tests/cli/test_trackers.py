"""logger=[tensorboard,wandb,mlflow]: every tracker holds what metrics.jsonl holds (W&B offline,
MLflow in a file store), the resolved config and the run's summary; a continuation after kill -9
reopens the same tracker runs and sends no step twice; an unknown logger or a missing package is
one `error:` line before anything is written."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args
from helpers.processes import logged_steps, paced, wait_for

from trainer.checkpoint.layout import checkpoint_step, latest_checkpoint

NUMBERS = ("loss", "lr", "grad_norm", "tokens_per_s", "tokens", "skipped", "val_loss")


def tracker_env(tmp_path: Path) -> dict[str, str]:
    """Offline, and nothing outside tmp_path: W&B's caches and settings, MLflow's store."""
    env = dtrain_env()
    for key in [k for k in env if k.startswith(("WANDB_", "MLFLOW_"))]:
        del env[key]
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
               MLFLOW_TRACKING_URI=(tmp_path / "mlruns").as_uri())
    return env


# --- reading W&B's offline transaction log (run-<id>.wandb): wandb 0.31 ships no Python reader -----
# The format is LevelDB's log: a 7-byte file header, then 32 KiB blocks of records, each with a
# 7-byte header (CRC-32 of type byte + data, length, type: full / first / middle / last).
_BLOCK, _HEADER = 32768, 7


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:_HEADER]) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:
            break  # zeroed space after the last record
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad record checksum"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def wandb_run(run_dir: Path) -> dict:
    """Each offline run folder under <run dir>/wandb/ in order: its id, history per key and step,
    config and summary."""
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert folders, f"no offline W&B run in {run_dir / 'wandb'}"
    runs = []
    for folder in folders:
        (log,) = folder.glob("run-*.wandb")
        history, config, summary, run_id = {}, {}, {}, None
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in record.history.item}
                for key, value in row.items():
                    history.setdefault(key, []).append((row["_step"], value))
            elif kind == "summary":
                summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        runs.append({"id": run_id, "folder": folder.name, "history": history, "config": config, "summary": summary})
    return runs


def mlflow_history(run_dir: Path, env: dict, key: str) -> list[tuple[int, float]]:
    import mlflow

    entry = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert entry["tracking_uri"] == env["MLFLOW_TRACKING_URI"]
    return sorted((m.step, m.value) for m in client.get_metric_history(entry["run_id"], key))


def jsonl_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        for key in NUMBERS:
            if isinstance(record.get(key), (int, float)):
                series.setdefault(key, {})[record["step"]] = record[key]
    return {key: sorted(values.items()) for key, values in series.items()}


@pytest.fixture(autouse=True)
def file_store(monkeypatch):
    """This process reads MLflow's file store, which MLflow 3 refuses unless allowed."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.mark.slow
def test_wandb_and_mlflow_log_what_metrics_jsonl_holds(data_dir, tmp_path):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    run, env = tmp_path / "run", tracker_env(tmp_path)
    run_dtrain(tiny_args(data_dir, run, "logger=[tensorboard,wandb,mlflow]", "train.max_steps=8",
                         "train.val_interval=4"), check=True, env=env)
    expected = jsonl_series(run)
    assert set(expected) == set(NUMBERS) and [s for s, _ in expected["loss"]] == list(range(1, 9))
    summary = read_metrics(run)[-1]["summary"]
    config = json.loads((run / "resolved_config.json").read_text())
    trackers = json.loads((run / "trackers.json").read_text())

    (wb,) = wandb_run(run)
    assert wb["id"] == trackers["wandb"]["id"]
    for key, values in expected.items():
        assert wb["history"][key] == values, key  # the same numbers at the same steps, each once
    assert {k: v for k, v in wb["config"].items() if k != "_wandb"} == config
    assert wb["summary"]["summary"] == {k: v for k, v in summary.items() if v is not None}

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    for key, values in expected.items():
        assert mlflow_history(run, env, key) == values, key
    got = client.get_run(trackers["mlflow"]["run_id"])
    assert got.info.status == "FINISHED"
    assert got.data.params["model.n_layer"] == str(config["model"]["n_layer"])
    assert got.data.params["optim.betas"] == str(config["optim"]["betas"])
    for key, value in summary.items():
        if value is not None:
            assert mlflow_history(run, env, f"summary.{key}") == [(8, value)]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_a_continuation_reopens_the_same_tracker_runs_without_repeating_a_step(data_dir, tmp_path):
    """kill -9 past a checkpoint: the continuation resumes at the checkpoint, while the trackers
    already have the steps after it; they keep one value per step and the same run."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    run, env, log = tmp_path / "run", tracker_env(tmp_path), tmp_path / "killed.log"
    args = tiny_args(data_dir, run, "logger=[wandb,mlflow]", "train.max_steps=12", "checkpoint.interval=4")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=paced(env), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_for(lambda: logged_steps(run)[-1:] >= [6], proc, log)  # past the step-4 checkpoint
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    killed_steps = logged_steps(run)
    resumed_at = checkpoint_step(latest_checkpoint(run))
    assert resumed_at < killed_steps[-1], "no logged step after the checkpoint: nothing to test"
    first = json.loads((run / "trackers.json").read_text())

    again = run_dtrain(args, env=env)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"(step {resumed_at})" in again.stderr
    assert json.loads((run / "trackers.json").read_text()) == first  # the same W&B and MLflow runs
    steps = list(range(1, 13))
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == steps
    losses = mlflow_history(run, env, "loss")
    assert [s for s, _ in losses] == steps  # each step once, none missing
    # A deterministic continuation recomputes the same losses: the killed run's values stand.
    assert losses == jsonl_series(run)["loss"]

    runs = wandb_run(run)
    # one W&B run, resumed in a second folder (W&B names a folder after its run id); the killed run's
    # own run record may not have reached its log before the kill
    run_id = first["wandb"]["id"]
    assert [r["folder"].rsplit("-", 1)[1] for r in runs] == [run_id] * 2
    assert runs[0]["id"] in (run_id, None) and runs[1]["id"] == run_id
    resumed = [s for s, _ in runs[1]["history"]["loss"]]
    assert resumed == list(range(killed_steps[-1] + 1, 13))  # only what the killed run had not sent
    sent_before = {s for s, _ in runs[0]["history"].get("loss", [])}
    assert not sent_before & set(resumed)


def test_unknown_logger_is_one_line(data_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run, "logger=[tensorboard,wandbb]"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "'wandbb' is unknown; choose from jsonl, tensorboard, wandb, mlflow" in proc.stderr
    assert not run.exists()


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_one_line_with_the_install_command(name, data_dir, tmp_path):
    run = tmp_path / "run"
    code = (f"import sys; sys.modules[{name!r}] = None; sys.argv = ['dtrain'] + sys.argv[1:]; "
            "from trainer.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, *tiny_args(data_dir, run, f"logger=[{name}]")],
                          cwd=REPO, capture_output=True, text=True, env=dtrain_env(), timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pip install 'dtrain[{name}]'" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (run / "metrics.jsonl").exists() and not (run / "trackers.json").exists()
