"""`dtrain eval RUN --tasks ... world=2` (the requests split over two gloo workers) gives exactly
world=1's metrics and per-request records, a task that samples runs (reproducibly, by its seed),
and `--log-samples` writes the harness's own per-request records to <RUN_DIR>/eval_samples_<task>.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.dtrain import run_dtrain
from helpers.evals import GREEDY, TASKS, evaluate, offline_env, work_offline

work_offline()

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.loggers import EvaluationTracker  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402


@pytest.fixture(scope="module")
def both(harness_run, harness_tasks, harness_world1):
    """The session's world-1 evaluation (shared with test_harness) and the same command at world 2."""
    return harness_world1, evaluate(harness_run, harness_tasks, "world=2", "launch.threads_per_worker=1")


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_world_2_gives_world_1s_metrics_exactly(both):
    (rec1, samples1), (rec2, samples2) = both
    assert rec1["world"] == 1 and rec2["world"] == 2 and rec2["threads_per_worker"] == 1
    assert same(rec1["results"], rec2["results"]), (rec1["results"], rec2["results"])
    assert rec1["requests"] == rec2["requests"] and rec1["n-samples"] == rec2["n-samples"]
    for task in TASKS:  # and every request's answer, sampled generations included
        assert [s["resps"] for s in samples1[task]] == [s["resps"] for s in samples2[task]], task


@pytest.mark.slow
def test_a_sampling_task_runs_and_differs_from_greedy(both):
    (record, samples), _ = both
    assert "exact_match,none" in record["results"]["dtrain_sampled"]
    greedy = [s["resps"] for s in samples["dtrain_gen"]]
    sampled = [s["resps"] for s in samples["dtrain_sampled"]]
    assert len(sampled) == len(greedy) == 8 and sampled != greedy


@pytest.mark.slow
def test_log_samples_are_the_harness_records(both, harness_hf_model, harness_tasks, tmp_path):
    """The same fields, documents and answers as the harness's own --log_samples files of its `hf`
    model on the exported weights (loglikelihoods within float noise, generations exact)."""
    (record, ours), _ = both
    assert record["samples"] == {t: str(Path(record["run_dir"]) / f"eval_samples_{t}.jsonl") for t in TASKS}
    results = simple_evaluate(model=harness_hf_model, tasks=GREEDY,
                              task_manager=TaskManager(include_path=str(harness_tasks)), bootstrap_iters=20,
                              log_samples=True)
    tracker = EvaluationTracker(output_path=str(tmp_path))
    tracker.general_config_tracker.model_name_sanitized, tracker.date_id = "hf", "now"  # set by its other calls
    for task in GREEDY:
        tracker.save_results_samples(task, results["samples"][task])
        [path] = tmp_path.rglob(f"samples_{task}_*.jsonl")
        theirs = [json.loads(line) for line in path.read_text().splitlines()]
        assert [set(s) for s in ours[task]] == [set(s) for s in theirs]
        assert {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "doc_hash"} <= set(ours[task][0])
        for a, b in zip(ours[task], theirs):
            assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"] and a["target"] == b["target"]
            if task == "dtrain_gen":
                assert a["resps"] == b["resps"] and a["filtered_resps"] == b["filtered_resps"]
            else:
                flat_a, flat_b = json.dumps(a["resps"]), json.dumps(b["resps"])
                assert len(flat_a.split(",")) == len(flat_b.split(","))
                for x, y in zip(a["filtered_resps"], b["filtered_resps"]):
                    x, y = (x[0], y[0]) if isinstance(x, list) else (x, y)
                    assert math.isclose(float(x), float(y), rel_tol=1e-5), (task, x, y)


@pytest.mark.slow
def test_unsupported_generation_settings_are_one_line(harness_run, harness_tasks, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    text = (harness_tasks / "dtrain_gen.yaml").read_text().replace("task: dtrain_gen", "task: dtrain_bad")
    (bad / "dtrain_bad.yaml").write_text(text.replace("do_sample: false", "do_sample: false\n  num_beams: 4"))
    proc = run_dtrain(["eval", str(harness_run), "--tasks", "dtrain_bad", "--include-path", str(bad)],
                      env=offline_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "num_beams" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
