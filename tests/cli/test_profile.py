"""train.profile.steps (issue 48, item 1): every rank's trace of the chosen steps, readable as gzip
JSON with the steps' ops in it, rank 0's table naming real ops, and the steps' seconds counted as
excluded ("profile"), not training, in every mode and in a sweep's points."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from helpers.dtrain import args_with, read_metrics, run_dtrain, tiny_args

PROFILED = "train.profile.steps=[3,4]"


def profiled_run(data_dir: Path, run_dir: Path, *extra: str) -> str:
    """A 6-step tiny run profiling steps 3-4; its stdout."""
    return run_dtrain(args_with(data_dir, run_dir, "train.max_steps=6", "optim.warmup_steps=2", PROFILED, *extra),
                      check=True).stdout


def trace_names(trace: Path) -> set[str]:
    with gzip.open(trace, "rt") as f:  # gzip, as the .gz says (export_chrome_trace)
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def assert_profiled(run_dir: Path, stdout: str, world: int) -> None:
    for rank in range(world):
        names = trace_names(run_dir / "profile" / f"rank{rank}.json.gz")
        assert {"dtrain step 3", "dtrain step 4"} <= names  # the window, step by step
        assert "dtrain step 5" not in names and "dtrain step 2" not in names
        assert names & {"aten::mm", "aten::addmm"}  # the steps' matmuls
    table = stdout[stdout.index("profile of steps 3-4"):]
    header, *rows = table.splitlines()[:14]
    assert re.search(r"mean step [\d.]+ ms, communication in flight [\d.]+% of it", header), header
    assert any(row.split()[0] in ("aten::mm", "aten::addmm") for row in rows[1:]), table  # real ops, ranked
    mean_s = float(re.search(r"mean step ([\d.]+) ms", header).group(1)) / 1e3
    summary = read_metrics(run_dir)[-1]
    excluded = summary["excluded_s"]
    # the two profiled steps (and the trace's export) count as "profile", not as training
    assert excluded["profile"] >= 2 * mean_s * 0.99, (excluded, mean_s)
    figures = summary["summary"]
    assert figures["train_s"] + sum(excluded.values()) <= figures["wall_s"]  # each second counted once
    # every step is logged (train.log_interval=1), each its own window: training time and tokens/s are
    # steps 2, 5 and 6 alone (step 1 is warm-up; 3 and 4 are profiled)
    steps = {r["step"]: r for r in read_metrics(run_dir) if "tokens_per_s" in r}
    step_tokens = steps[2]["tokens"] - steps[1]["tokens"]
    training = [step_tokens / steps[s]["tokens_per_s"] for s in (2, 5, 6)]
    assert figures["train_s"] == pytest.approx(sum(training), rel=1e-6)
    assert figures["train_tokens_per_s"] == pytest.approx(3 * step_tokens / sum(training), rel=1e-6)


def test_profile_of_two_steps(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    stdout = profiled_run(data_dir, run_dir)
    assert_profiled(run_dir, stdout, world=1)
    assert stdout.index("step 4/6") < stdout.index("profile of steps 3-4") < stdout.index("step 5/6")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_profile_in_every_rank(mode, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    stdout = profiled_run(data_dir, run_dir, f"parallel={mode}", "world=2")
    assert_profiled(run_dir, stdout, world=2)
    header = stdout[stdout.index("profile of steps 3-4"):].splitlines()[0]
    share = float(re.search(r"communication in flight ([\d.]+)%", header).group(1))
    assert share > 0  # the gradients' all-reduce (ddp) or gathers and reduce-scatters (fsdp) are seen


@pytest.mark.slow
def test_profile_in_each_sweep_point(data_dir, tmp_path):
    sweep = tmp_path / "sweep"
    run_dtrain(tiny_args(data_dir, sweep, "optim.lr=1e-3,2e-3", "train.profile.steps=[2,3]", sweep=True), check=True)
    traces = sorted(sweep.rglob("profile/rank0.json.gz"))
    assert len(traces) == 2 and traces[0].parent != traces[1].parent  # each point's own run dir
    for trace in traces:
        assert {"dtrain step 2", "dtrain step 3"} <= trace_names(trace)
        assert "profile" in read_metrics(trace.parents[1])[-1]["excluded_s"]
