"""scripts/bench.py stays runnable (a quick smoke of each of its parts), and the loop's MFU field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args, tokenizer_args

BENCH = REPO / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its MFU figures are checked against
    GPT-2-vocabulary models."""
    return gpt2_data_dir


def bench(args, data_dir, tmp_path, timeout=300):
    out = tmp_path / "bench.json"
    data = ["data=text", "data.name=corpus", f"data.dir={data_dir}", *tokenizer_args(data_dir)]
    proc = subprocess.run([sys.executable, str(BENCH), *args, "--json", str(out), *data], cwd=REPO,
                          env=dtrain_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_bench_table_smoke(data_dir, tmp_path):
    result, stdout = bench(["--model", "tiny", "--modes", "none@1,fsdp@2", "--steps", "1",
                            "--warmup", "1", "--micro-batch", "2", "--seq-len", "32"], data_dir, tmp_path)
    rows = {(r["mode"], r["world"]): r for r in result["table"]}
    assert set(rows) == {("none", 1), ("fsdp", 2)}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["peak_bytes"] > 0 and r["plan_bytes"] > 0
        assert r["compute_s"] > 0 and r["data_s"] >= 0 and r["optim_s"] > 0
        assert len(r["ranks"]) == r["world"]
    full = rows[("none", 1)]
    assert full["param_bytes"] == full["grad_bytes"] == full["full_param_bytes"]
    assert full["optim_bytes"] >= 2 * full["param_bytes"]
    assert rows[("fsdp", 2)]["param_bytes"] <= full["param_bytes"] / 2 * 1.01  # sharded
    assert "tok/s" in stdout and "FSDP world 2" in stdout


@pytest.mark.slow
def test_bench_vs_bare_and_tokenize_smoke(data_dir, tmp_path):
    result, stdout = bench(["--vs-bare", "--tokenize", "--tokenize-mb", "0.3", "--model", "tiny",
                            "--modes", "none@1", "--rounds", "2", "--block", "1", "--warmup", "1",
                            "--micro-batch", "2", "--seq-len", "32"], data_dir, tmp_path)
    (row,) = result["vs_bare"]
    assert row["dtrain_tokens_per_s"] > 0 and row["bare_tokens_per_s"] > 0 and row["ratio"] > 0
    assert len(row["round_ratios"]) == 2 and min(row["round_ratios"]) <= row["ratio"] <= max(row["round_ratios"])
    tok = result["tokenize"]
    assert tok["tokens_match"] and tok["pool_tokens_per_s"] > 0 and tok["tiktoken_tokens_per_s"] > 0
    assert "bare tok/s" in stdout and "tiktoken" in stdout


def test_bench_rejects_unknown_mode(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--modes", "tp"], cwd=REPO, env=dtrain_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown mode 'tp'" in proc.stdout


@pytest.mark.slow
def test_metrics_carry_mfu_when_the_peak_is_known(data_dir, tmp_path):
    from trainer.config.compose import compose
    from trainer.model.gpt import build_model

    run_dtrain(tiny_args(data_dir, tmp_path / "mfu", "train.max_steps=3", "train.peak_flops=1e12"),
               check=True)
    train = [r for r in read_metrics(tmp_path / "mfu") if "loss" in r]
    assert train, "no training records"
    flops = build_model(compose(["model=tiny"]).model).flops_per_token(64)
    for r in train:
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / 1e12, rel=1e-4)
    run_dtrain(tiny_args(data_dir, tmp_path / "plain", "train.max_steps=2"), check=True)
    assert all("mfu" not in r for r in read_metrics(tmp_path / "plain"))  # CPU, no peak given


@pytest.mark.slow
def test_compile_with_validation_hellaswag_and_sampling(data_dir, tmp_path):
    hs = tmp_path / "hs.jsonl"
    hs.write_text("".join(json.dumps({"ctx": f"the king {i}", "endings": ["a", "b c", "d", "e f g"],
                                      "label": i % 4}) + "\n" for i in range(8)))
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "train.compile=true", "train.max_steps=4",
                                "train.val_interval=2", "eval.hellaswag.interval=2", f"eval.hellaswag.path={hs}",
                                "train.sample_tokens=8"), check=True)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert [r["step"] for r in records if "hellaswag_acc_norm" in r] == [2, 4]
    assert "sample:" in proc.stdout
