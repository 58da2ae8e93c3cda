"""scripts/bench_gpu.py (`make bench-gpu`): one line and exit 2 without CUDA; its table on tiny CPU models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers.dtrain import REPO, dtrain_env, tokenizer_args

from trainer.parallel import STRATEGIES


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its rows are GPT-2-vocabulary models."""
    return gpt2_data_dir


def bench_gpu(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**dtrain_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "scripts/bench_gpu.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    proc = bench_gpu()
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "no CUDA device visible" in lines[0], proc.stderr


def test_gpu_session_checks_its_steps_then_its_bundle_before_anything(tmp_path):
    """scripts/gpu_session.sh (a lent GPU's checks): an unknown step, then a missing `make gpu-bundle`,
    each one line and exit 2, before it installs or writes anything."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gpu_session.sh", tmp_path / "scripts")
    out = tmp_path / "out"

    def session(*steps):
        return subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_session.sh"), *steps], capture_output=True,
                              text=True, env={**dtrain_env(), "OUT": str(out)}, timeout=60)

    proc = session("tests", "benchmark")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: unknown step benchmark; the steps are tests, bench[:SECTIONS[:BUDGET_S]] and train"], proc.stderr
    proc = session("tests", "bench:watch:60")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: .whl is missing: run make gpu-bundle here, then carry .whl and .device"], proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_tiny_cpu_run_prints_every_section(data_dir, tmp_path):
    out, data = tmp_path / "rows.json", tmp_path / "data"
    for name in ("corpus", "corpus_b"):  # the mixture row's two prepared sources
        shutil.copytree(data_dir / "corpus", data / name)
    # --batches 4: the middle batch alone (the rows measured against it need it; each other batch is
    # the same code again, and test_sections_and_batches_pick_the_rows measures another)
    proc = bench_gpu("--device", "cpu", "--tiny", "--warmup", "1", "--rounds", "1", "--block", "1", "--batches", "4",
                     "--json", str(out), "--mix", "corpus:0.7,corpus_b:0.3",
                     "data=text", "data.name=corpus", f"data.dir={data}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["section"] for r in rows} == {"throughput", "muon", "lion", "mixture", "memory", "modes", "choices",
                                            "watch", "kernels"}
    sample, recorder = [r for r in rows if r["section"] == "watch"]
    assert sample["case"] == "tiny B=4 straggler sample" and sample["figures"]["first_ms"] > 0, sample
    assert sample["figures"]["ms"] > 0 and sample["figures"]["default_ms"] > 0, sample
    # fresh processes on gloo, which keeps no flight record: the code runs, nothing is recorded
    assert "(gloo, which has no recorder) flight recorder" in recorder["case"], recorder
    assert [f["entries"] for f in recorder["figures"]["on"] + recorder["figures"]["off"]] == [0] * 4, recorder
    for section in ("muon", "lion", "mixture"):  # each against AdamW's step on one dataset
        (row,) = [r for r in rows if r["section"] == section]
        assert row["figures"]["ms"] > 0 and row["figures"]["default_ms"] > 0, row
    (chunks,) = [r for r in rows if r["section"] == "choices"]  # compile_mode needs compile: not tiny
    assert "train.loss_chunks=4" in chunks["case"] and chunks["figures"]["ms"] > 0, chunks
    measured = [r for r in rows if r["section"] == "throughput" and "figures" in r]
    assert measured and all(r["figures"]["dtrain"]["tokens_per_s"] > 0 and r["figures"]["bare"]["ms"] > 0
                            for r in measured)
    modes = [r for r in rows if r["section"] == "modes"]
    assert len(modes) == len(STRATEGIES) and all(r["ratio"] == "ok" or "skipped" in r["dtrain"] for r in modes), modes
    assert "dtrain on cpu, torch" in proc.stdout
    kernels = {r["case"]: r for r in rows if r["section"] == "kernels"}
    for case in ("tiny B=4x64 train.loss_kernel=chunked train.loss_chunks=4", "llama_tiny B=4x64 model.attention=flash",
                 "llama_tiny B=4x64 train.float8=rowwise"):  # measured against their group's baseline
        figures = kernels[case]["figures"]
        assert figures["tokens_per_s"] > 0 and figures["peak_bytes"] > 0 and figures["steps"] == 4, case
        assert abs(figures["loss_gap"]) < 0.01, case
    assert kernels["llama_tiny B=4x64 train.float8=rowwise"]["figures"]["kernels"]["float8"] == "rowwise (8 layers)"
    # what a CPU cannot run is the line a run would print
    fused = kernels["tiny B=4x64 train.loss_kernel=fused"]["dtrain"]
    assert "refused: train.loss_kernel=fused runs liger-kernel" in fused
    assert "refused: model.attention=cudnn" in kernels["tiny B=4x64 model.attention=cudnn"]["dtrain"]
    assert kernels["tiny loss pick"]["dtrain"].startswith("train.loss_kernel=")
    assert {f"{m} {g} pick" for m in ("tiny", "llama_tiny") for g in ("attention", "float8")} < set(kernels)


@pytest.mark.slow
def test_sections_and_batches_pick_the_rows(data_dir, tmp_path):
    out = tmp_path / "rows.json"
    proc = bench_gpu("--device", "cpu", "--tiny", "--warmup", "1", "--rounds", "1", "--block", "1",
                     "--sections", "throughput", "--batches", "2", "--json", str(out),
                     "data=text", "data.name=corpus", f"data.dir={data_dir}", *tokenizer_args(data_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["section"], r["case"]) for r in rows] == [("throughput", "tiny B=2"), ("throughput", "llama_tiny B=2")]
