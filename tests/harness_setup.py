"""lm-evaluation-harness fixtures, one of each per test session for test_harness and
test_harness_workers (a plugin: conftest's pytest_plugins): a trained run, local tasks over jsonl
files (offline), the harness's own `hf` model on the run's export, and the run's world-1
`dtrain eval --tasks` whose metrics and records both modules check. lm_eval is imported only by the
fixture that needs it: conftest loads this module in every environment, with or without the extra."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import corpus_text, dtrain_env, run_dtrain, tiny_args

GREEDY = ["dtrain_mc", "dtrain_ppl", "dtrain_gen"]  # what the harness's own `hf` model is compared on
TASKS = [*GREEDY, "dtrain_sampled"]
BATCH = 4
BOOTSTRAP = 50


def work_offline() -> None:
    """Called by the harness test modules before they import the harness (and through it
    huggingface_hub and datasets), which read these once. The tasks read local jsonl files and the
    `hf` model a local folder; nothing is fetched."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def offline_env() -> dict[str, str]:
    env = dtrain_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


@pytest.fixture(scope="session")
def harness_run(data_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("harness") / "run"
    run_dtrain(tiny_args(data_dir, run, "train.max_steps=10"), check=True)
    return run


@pytest.fixture(scope="session")
def harness_tasks(tmp_path_factory) -> Path:
    """Four local tasks over jsonl files: multiple choice (acc, acc_norm), rolling loglikelihood
    (perplexities, documents longer than the 128-token block), greedy generation and generation
    that samples (temperature, top_k, top_p)."""
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="session")
def harness_hf_model(harness_run, tmp_path_factory):
    """The harness's own `hf` model on `dtrain export`'s folder (weights, config, tokenizer files)."""
    from lm_eval.models.huggingface import HFLM  # the optional harness extra: only where it is used

    out = tmp_path_factory.mktemp("export") / "hf"
    run_dtrain(["export", str(harness_run), "--out", str(out)], check=True)
    return HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=BATCH)


@pytest.fixture(scope="session")
def harness_world1(harness_run, harness_tasks) -> tuple[dict, dict[str, list[dict]]]:
    """`dtrain eval --tasks` at world 1: its record and per-request samples (test_harness compares
    them with the `hf` model, test_harness_workers with world 2)."""
    return evaluate(harness_run, harness_tasks)


def write_tasks(root: Path) -> Path:
    # passages of 40 words: the shared corpus's paragraphs are too uneven, and a clone without it
    # gets generated text with none
    words = corpus_text().split()
    paras = [" ".join(words[i * 40:(i + 1) * 40]) for i in range(200)]
    mc = []
    for i in range(12):
        words = paras[i * 7].split()
        right = " ".join(words[8:14])
        choices = [right] + [" ".join(paras[i * 7 + k].split()[8:14]) for k in (1, 2, 3)]
        choices = choices[i % 4:] + choices[: i % 4]
        mc.append({"question": " ".join(words[:8]), "choices": choices, "label": choices.index(right)})
    docs = [{"text": "\n\n".join(paras[i * 5: i * 5 + 4])} for i in range(6)]
    gen = [{"question": p[:120], "answer": p[120:130]} for p in paras[100:108]]
    for name, rows in (("mc", mc), ("docs", docs), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name: str, data: str, body: str) -> None:
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / data}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n")

    task("dtrain_mc", "mc.jsonl", 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
         'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n'
         "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
         "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    task("dtrain_ppl", "docs.jsonl", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
         'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
         "  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    task("dtrain_gen", "gen.jsonl", 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
         'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n'
         "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
         "    higher_is_better: true\n")
    gen = (root / "dtrain_gen.yaml").read_text()
    (root / "dtrain_sampled.yaml").write_text(gen.replace("task: dtrain_gen", "task: dtrain_sampled").replace(
        "do_sample: false", "do_sample: true\n  temperature: 0.9\n  top_k: 40\n  top_p: 0.95"))
    return root


def evaluate(run: Path, tasks: Path, *extra: str) -> tuple[dict, dict[str, list[dict]]]:
    """The real command, `dtrain eval RUN_DIR --tasks ... --include-path DIR --log-samples`: its
    eval_harness.json and each task's per-request records."""
    proc = run_dtrain(["eval", str(run), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
                       "--batch-size", str(BATCH), "--bootstrap-iters", str(BOOTSTRAP), "--device", "cpu",
                       "--log-samples", *extra], env=offline_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "acc_norm" in proc.stdout and "eval_harness.json" in proc.stdout, proc.stdout
    record = json.loads((run / "eval_harness.json").read_text())
    samples = {t: [json.loads(line) for line in (run / f"eval_samples_{t}.jsonl").read_text().splitlines()]
               for t in TASKS}
    return record, samples
