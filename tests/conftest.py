"""Shared fixtures: one small prepared dataset per test session, and a way to run `dtrain`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINYSHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
pytest_plugins = ["harness_setup"]  # the harness fixtures: one trained run, export and evaluation per session


def corpus_text() -> str:
    """The tiny-shakespeare corpus when the shared copy is here, else generated English-like text."""
    if TINYSHAKESPEARE.exists():
        return TINYSHAKESPEARE.read_text()
    import random

    rng = random.Random(0)
    words = ("the king hath spoken and my lord shall come to the court of rome where all the "
             "people cry for bread and wine good night sweet prince").split()
    lines = []
    for i in range(20000):
        lines.append(("ROMEO:" if i % 7 == 0 else "") + " ".join(rng.choice(words) for _ in range(10)))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A prepared `text` dataset named `corpus` (about 300k tokens) shared by the whole session."""
    root = tmp_path_factory.mktemp("data")
    source = root / "corpus.txt"
    source.write_text(corpus_text())
    run_dtrain(["prepare", "data=text", "data.name=corpus", f"data.source={source}", f"data.dir={root}",
                "data.val_fraction=0.1"], check=True)
    return root


def dtrain_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HYDRA_FULL_ERROR"] = "0"
    return env


def run_dtrain(args: list[str], cwd: Path | None = None, check: bool = False, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or dtrain_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"dtrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tiny_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """A fast tiny-model training run on the session dataset."""
    return ["train", "model=tiny", "data=text", "data.name=corpus", f"data.dir={data_dir}",
            "train.max_steps=20", "train.log_interval=1", "train.val_interval=0", "train.val_batches=2",
            "train.sample_tokens=0", "train.progress=false", "train.micro_batch_size=4", "train.seq_len=64",
            "optim.warmup_steps=5", f"hydra.run.dir={run_dir}", *extra]


# The one-process run of 256-token steps (tiny model, AdamW, accumulation 4) that test_parity's
# modes must track and test_muon's Muon must leave: made once per session for both.
REFERENCE_STEPS = 16
REFERENCE_BATCH = ["train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={REFERENCE_STEPS}",
                   "optim.lr=1e-3"]
ONE_PROCESS = ["parallel=none", "train.micro_batch_size=2"]  # the reference: accumulation 4
# Muon's runs of the same batches (test_muon, test_compat): decay on, so fsdp's per-shard decay is
# checked too, and a checkpoint every 4 steps, so a parity run is also a resume test's reference.
MUON_BATCH = ["optim=muon", *REFERENCE_BATCH, "optim.muon.weight_decay=0.1", "checkpoint.interval=4"]
# Each parallel mode at world 2 (or one process) on those 256-token steps, as test_parity,
# test_muon and test_compat run them: micro batch x 32 tokens x world x accumulation = 256.
MODE_RUNS = {
    "none": ["parallel=none", "train.micro_batch_size=8"],
    "dp": ["parallel=dp", "train.micro_batch_size=4"],
    "ddp": ["parallel=ddp", "world=2", "train.micro_batch_size=4"],
    "zero": ["parallel=zero", "world=2", "train.micro_batch_size=2"],
    "zero_torch": ["parallel=zero_torch", "world=2", "train.micro_batch_size=2"],
    "fsdp": ["parallel=fsdp", "world=2", "train.micro_batch_size=2"],
}
_SHARED_RUNS: dict[tuple[str, ...], tuple[Path, str]] = {}


@pytest.fixture(scope="session")
def shared_run(data_dir, tmp_path_factory):
    """args -> (run dir, stdout) of the uninterrupted `tiny_args(data_dir, <dir>, *args)` run,
    trained once per session: the modules that check the same run (test_parity's and test_compat's
    modes, test_muon's and test_compat's Muon runs, the references) share it. Read-only: a test
    that continues or damages a run makes its own."""
    root = tmp_path_factory.mktemp("shared_runs")

    def get(*args: str) -> tuple[Path, str]:
        if args not in _SHARED_RUNS:
            run_dir = root / f"run_{len(_SHARED_RUNS)}"
            _SHARED_RUNS[args] = run_dir, run_dtrain(tiny_args(data_dir, run_dir, *args), check=True).stdout
        return _SHARED_RUNS[args]

    return get


@pytest.fixture(scope="session")
def adamw_reference(shared_run) -> dict[int, float]:
    """step -> loss of the one-process AdamW reference (micro batch 2, accumulation 4)."""
    run_dir, _ = shared_run(*REFERENCE_BATCH, *ONE_PROCESS)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def assert_matches_one_process(want: dict[int, float], got: dict[int, float], steps: int, case: str) -> None:
    """Every step logged, each loss within 1e-5 of the single-process reference's."""
    assert sorted(got) == list(range(1, steps + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < 1e-5, f"{case}: max |loss - single| = {worst:.3g}"
