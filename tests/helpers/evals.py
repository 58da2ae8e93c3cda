"""Evaluation inputs: HellaSwag-format files, and the lm-evaluation-harness tasks (local jsonl
files, offline) with the world-1 `dtrain eval --tasks` that conftest.py's harness fixtures run once
per session. lm_eval is imported only by the fixture that needs it."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from helpers.dtrain import corpus_text, dtrain_env, run_dtrain
from trainer.evals.hellaswag_file import Example
from trainer.tokenizers.gpt2 import gpt2_encoding

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


def write_jsonl(path: Path, examples: list[Example]) -> Path:
    path.write_text("".join(json.dumps({"ctx": e.ctx, "endings": list(e.endings), "label": e.label}) + "\n"
                            for e in examples))
    return path


# --- a trained tiny model -------------------------------------------------------------------
def _continuations(text: str, k: int, rng: random.Random) -> list[tuple[str, str]]:
    """k (line, next line) pairs of the corpus, both lines of a few words."""
    lines = [ln.strip() for ln in text.splitlines()]
    pairs = [(lines[i], lines[i + 1]) for i in range(len(lines) - 1)
             if len(lines[i].split()) >= 4 and len(lines[i + 1].split()) >= 3]
    return rng.sample(pairs, k)


def make_examples(text: str, n_easy: int, n_hard: int, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Easy: the correct ending continues the corpus verbatim, the wrong ones are random token soup.
    Hard: four corpus lines, none the continuation, so nothing tells the labelled one apart."""
    enc = gpt2_encoding()
    rng = random.Random(seed)
    easy = []
    for ctx, nxt in _continuations(text, n_easy, rng):
        n_tok = max(2, len(enc.encode_ordinary(" " + nxt)))
        label = rng.randrange(4)
        soup = [enc.decode([rng.randrange(enc.n_vocab - 1) for _ in range(n_tok)]).strip() for _ in range(3)]
        easy.append(Example(ctx + "\n", tuple(soup[:label] + [nxt] + soup[label:]), label))
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) >= 4]
    hard = [Example(rng.choice(lines) + "\n", tuple(rng.sample(lines, 4)), rng.randrange(4))
            for _ in range(n_hard)]
    return easy, hard
