"""`dtrain eval RUN_DIR --tasks ...`: lm-evaluation-harness on a dtrain checkpoint, against the
harness's own `hf` model on the exported weights (offline: local task YAMLs over jsonl files)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from helpers.dtrain import REPO, corpus_text, dtrain_env, run_dtrain, tiny_args
from helpers.evals import BATCH, BOOTSTRAP, GREEDY, TASKS, offline_env, work_offline

work_offline()

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows  # noqa: E402

from trainer.commands.eval import cmd_eval  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.evals.harness import DtrainLM  # noqa: E402
from trainer.weights.from_checkpoint import model_from_run  # noqa: E402


@pytest.fixture
def ours(harness_world1) -> dict:
    """eval_harness.json of the session's `dtrain eval RUN_DIR --tasks ... --include-path DIR`."""
    return harness_world1[0]


def _close(a, b, rel: float = 1e-6) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=rel) or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.slow
def test_metrics_equal_the_harness_hf_model_on_the_export(ours, harness_hf_model, harness_tasks):
    manager = TaskManager(include_path=str(harness_tasks))
    theirs = simple_evaluate(model=harness_hf_model, tasks=GREEDY, task_manager=manager, bootstrap_iters=BOOTSTRAP,
                             log_samples=False)
    assert set(ours["results"]) == set(TASKS) and set(theirs["results"]) == set(GREEDY)
    for task, metrics in theirs["results"].items():
        assert set(ours["results"][task]) == set(metrics), task
        for key, value in metrics.items():
            assert _close(ours["results"][task][key], value), (task, key, ours["results"][task][key], value)
    mc = ours["results"]["dtrain_mc"]
    assert {"acc,none", "acc_norm,none", "acc_stderr,none"} <= set(mc) and 0 <= mc["acc,none"] <= 1
    ppl = ours["results"]["dtrain_ppl"]
    assert ppl["bits_per_byte,none"] > 0 and ppl["word_perplexity,none"] > 1
    assert {t: ours["versions"][t] for t in GREEDY} == theirs["versions"]
    assert {t: ours["n-samples"][t] for t in GREEDY} == theirs["n-samples"]


def test_request_by_request_equal_to_hf(harness_run, harness_hf_model):
    """The raw answers, on the cases where the two could part: an empty context (the <|endoftext|>
    prefix), a context's trailing space, a context longer than the block (left truncation), one-token
    continuations sharing a context (one forward), documents of several rolling windows, greedy
    generation with a stop string and a prompt longer than the block."""
    model, _ = model_from_run(harness_run)
    lm = DtrainLM(model, batch_size=BATCH)
    text = corpus_text()
    long = text[:2000]  # ~500 tokens against a block of 128
    pairs = [("", "To be, or not to be"), ("ROMEO: ", "What light"), ("KING:", " my lord"), (long, " and so"),
             ("The", " king"), ("The", " queen"), ("The", " Duke of York"), ("First Citizen:\n", "Before we")]

    def req(kind, args):
        return [Instance(kind, {}, a, i) for i, a in enumerate(args)]

    ll_ours = lm.loglikelihood(req("loglikelihood", pairs))
    ll_hf = harness_hf_model.loglikelihood(req("loglikelihood", pairs))
    assert [g for _, g in ll_ours] == [g for _, g in ll_hf]
    assert all(_close(a, b) for (a, _), (b, _) in zip(ll_ours, ll_hf)), (ll_ours, ll_hf)

    docs = [(text[:50],), (text[1000:2500],), (text[5000:9000],)]
    roll_ours = lm.loglikelihood_rolling(req("loglikelihood_rolling", docs))
    roll_hf = harness_hf_model.loglikelihood_rolling(req("loglikelihood_rolling", docs))
    assert all(_close(a, b) for a, b in zip(roll_ours, roll_hf)), (roll_ours, roll_hf)

    line = {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}
    free = {"until": ["never said"], "max_gen_toks": 16}  # runs to max_gen_toks (or <|endoftext|>)
    prompts = [(text[:80], line), (long, free), ("KING HENRY:", {"until": ["."], "max_gen_toks": 20}),
               ("ROMEO:", line), ("ROMEO:", free)]
    gen_ours = lm.generate_until(req("generate_until", prompts))
    gen_hf = harness_hf_model.generate_until(req("generate_until", prompts))
    assert gen_ours == gen_hf
    assert len(gen_ours[1]) >= 8 and len(gen_ours[4]) >= 8, gen_ours  # no stop string: it ran on
    assert "\n" not in gen_ours[0] + gen_ours[3] and "." not in gen_ours[2]
    # Each rolling window is one loglikelihood request as well.
    windows = sum(len(list(get_rolling_token_windows(lm.tok_encode(d), 50256, lm.max_length, 1))) for (d,) in docs)
    assert windows > len(docs)  # documents longer than the block: several windows
    assert lm.requests == {"loglikelihood": len(pairs) + windows, "loglikelihood_rolling": len(docs),
                           "generate_until": len(prompts)}


@pytest.mark.slow
def test_result_file_and_report(ours, harness_run):
    assert ours["step"] == 10 and ours["checkpoint"].endswith("checkpoints/step_000010")
    assert ours["tasks"] == TASKS and ours["batch_size"] == BATCH and ours["device"] == "cpu"
    assert ours["wall_s"] > 0 and ours["requests_per_s"] > 0 and ours["load_s"] >= 0
    kinds = {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    assert set(ours["model_s"]) == kinds and 0 < sum(ours["model_s"].values()) < ours["wall_s"]
    assert ours["n-samples"]["dtrain_mc"]["effective"] == 12 and ours["versions"]["dtrain_gen"] == 1.0
    pytest.importorskip("matplotlib")
    proc = run_dtrain(["report", str(harness_run)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for needle in ("lm-evaluation-harness", "dtrain_mc", "acc_norm", "bits_per_byte", "exact_match"):
        assert needle in proc.stdout, proc.stdout


@pytest.mark.slow
def test_limit_and_step(harness_run, harness_tasks, tmp_path):
    """--limit scores the first N documents of each task; --step picks a checkpoint."""
    proc = run_dtrain(["eval", str(harness_run), "--tasks", "dtrain_mc", "--include-path", str(harness_tasks),
                       "--limit", "5", "--step", "10", "--bootstrap-iters", "0"], env=offline_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((harness_run / "eval_harness.json").read_text())
    assert record["limit"] == 5 and record["n-samples"]["dtrain_mc"]["effective"] == 5
    assert record["requests"] == {"loglikelihood": 20} and record["step"] == 10


def test_missing_extra_is_one_line_naming_the_install(harness_run, tmp_path):
    """With lm_eval unimportable (a sitecustomize blocks it, as an environment without the extra
    would), --tasks is one `error:` line, exit 2, before any weights are read: even a corrupt
    checkpoint given as ckpt= is not looked at."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['lm_eval'] = None\n")
    env = offline_env()
    env["PYTHONPATH"] = os.pathsep.join([str(block), str(REPO)])
    corrupt = tmp_path / "step_000010"
    corrupt.mkdir()
    record = harness_run / "eval_harness.json"
    before = record.stat().st_mtime_ns if record.exists() else None
    for extra in ([], [f"ckpt={corrupt}"]):
        proc = run_dtrain(["eval", str(harness_run), "--tasks", "hellaswag", *extra], env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
        assert "pip install 'dtrain[harness]'" in lines[0] and "Traceback" not in proc.stderr
    after = record.stat().st_mtime_ns if record.exists() else None
    assert before == after


@pytest.mark.slow
def test_task_data_that_cannot_be_fetched_is_one_line(harness_run, harness_tasks, tmp_path):
    """A task whose data lives on the Hub, offline: one `error:` line, not datasets' traceback."""
    (tmp_path / "hub.yaml").write_text("task: dtrain_hub\ndataset_path: dtrain-tests/no-such-dataset\n"
                                       "test_split: test\noutput_type: loglikelihood_rolling\n"
                                       'doc_to_text: ""\ndoc_to_target: "{{text}}"\n')
    proc = run_dtrain(["eval", str(harness_run), "--tasks", "dtrain_hub", "--include-path", str(tmp_path)],
                      env=offline_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "could not fetch a task's data" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error:")


@pytest.mark.parametrize("args, needle", [
    (["--num-fewshot", "5"], "--num-fewshot goes with --tasks"),  # --limit and --step serve both scorers
    (["--limit", "2.5"], "takes a whole number of examples"),
    (["--limit", "5", "eval.limit=3"], "not both"),
    (["--step", "3", "ckpt=/x"], "not both"),
    (["--tasks", "x", "--limit", "5", "eval.limit=3"], "not both"),
    (["--tasks", ","], "--tasks names no task"),
    (["--tasks", "x", "parallel=ddp"], "does not apply to --tasks"),
    (["--tasks", "x", "world=0"], "a number of workers"),
    (["--tasks", "x", "launch.threads_per_worker=two"], "a number of CPU threads per worker"),
    (["--tasks", "x", "--step", "3", "ckpt=/x"], "not both"),
    (["--tasks", "x", "--limit", "2.5"], "a whole number"),
    (["--tasks", "x", "--include-path", "/nonexistent"], "/nonexistent does not exist"),
    (["--tasks", "x", "--device", "tpu9"], "--device"),
    (["--tasks", "x", "--batch-size", "0"], "--batch-size"),
])
def test_argument_errors(harness_run, args, needle):
    with pytest.raises(UserError) as err:
        cmd_eval([str(harness_run), *args])
    assert needle in str(err.value), str(err.value)


def test_unknown_task_and_missing_step(harness_run, harness_tasks):
    with pytest.raises(UserError) as err:
        cmd_eval([str(harness_run), "--tasks", "dtrain_mc,no_such_task", "--include-path", str(harness_tasks)])
    assert "unknown harness task(s) no_such_task" in str(err.value) and "--include-path" in str(err.value)
    with pytest.raises(UserError) as err:  # before the harness's task index is built
        cmd_eval([str(harness_run), "--tasks", "no_such_task", "--step", "7"])
    assert "no complete checkpoint at step 7" in str(err.value) and "[10]" in str(err.value)


def test_builtin_hellaswag_path_is_untouched_without_tasks(harness_run):
    """No --tasks: today's parser and checks (key=value overrides), and the eval command does not
    import the harness (only --tasks does)."""
    with pytest.raises(UserError) as err:
        cmd_eval([str(harness_run), "eval.nope=1"])
    assert "bad override" in str(err.value)
    code = "import sys, trainer.commands.eval; assert 'lm_eval' not in sys.modules, 'lm_eval imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dtrain_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_llama_rolling_loglikelihood_equals_the_hf_model_on_its_export(data_dir, harness_tasks, tmp_path):
    """A Llama-shaped run: `dtrain eval --tasks` on its checkpoint and the harness's `hf` model on
    its export (a LlamaForCausalLM) give the same perplexities, documents longer than the block."""
    run = tmp_path / "llama"
    run_dtrain(tiny_args(data_dir, run, "model=llama_tiny", "train.max_steps=10"), check=True)
    proc = run_dtrain(["eval", str(run), "--tasks", "dtrain_ppl", "--include-path", str(harness_tasks),
                       "--batch-size", str(BATCH), "--device", "cpu"], env=offline_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = json.loads((run / "eval_harness.json").read_text())["results"]["dtrain_ppl"]
    run_dtrain(["export", str(run), "--out", str(tmp_path / "hf")], check=True)
    hf = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=BATCH)
    assert type(hf.model).__name__ == "LlamaForCausalLM"
    theirs = simple_evaluate(model=hf, tasks=["dtrain_ppl"], task_manager=TaskManager(include_path=str(harness_tasks)),
                             log_samples=False)["results"]["dtrain_ppl"]
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert _close(ours[key], theirs[key], rel=1e-4), (key, ours[key], theirs[key])
    assert ours["word_perplexity,none"] > 1
