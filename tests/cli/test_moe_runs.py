"""A mixture-of-experts model with the rest of dtrain: model=qwen3_moe_tiny trained under
train.compile=true with activation checkpointing tracks the plain run, and its checkpoint serves
`dtrain sample` (KV-cache decoding through the experts) and `dtrain eval`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.dtrain import corpus_text, run_dtrain, tiny_args, train_losses
from helpers.evals import make_examples, write_jsonl

from trainer.evals.hellaswag import HellaSwagEval
from trainer.evals.hellaswag_file import read_examples
from trainer.process.runtime import Runtime
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.from_checkpoint import model_from_run

STEPS, SAMPLE_TOKENS, SEED = 4, 16, 1337
MOE = ["model=qwen3_moe_tiny", f"train.max_steps={STEPS}", "train.micro_batch_size=2", "train.seq_len=32",
       f"train.seed={SEED}", f"train.sample_tokens={SAMPLE_TOKENS}"]
SINGLE = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


@pytest.fixture(scope="module")
def moe_runs(data_dir, module_tmp):
    root = module_tmp.mktemp("moe_runs")
    runs = {}
    for name, extra in (("plain", []), ("compiled", ["train.compile=true", "train.activation_checkpointing=true"])):
        run_dir = root / name
        runs[name] = run_dir, run_dtrain(tiny_args(data_dir, run_dir, *MOE, *extra), check=True).stdout
    return runs


@pytest.mark.slow
def test_compile_and_activation_checkpointing_track_the_plain_run(moe_runs):
    plain, compiled = train_losses(moe_runs["plain"][0]), train_losses(moe_runs["compiled"][0])
    assert sorted(compiled) == list(range(1, STEPS + 1))
    # compiled kernels sum in another order (the grouped experts fall back to the loop under compile)
    worst = max(abs(plain[s] - compiled[s]) for s in plain)
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_sample_of_the_checkpoint_is_what_the_live_model_wrote(moe_runs):
    run_dir, stdout = moe_runs["plain"]
    live = stdout.split("sample:", 1)[1].split("run summary", 1)[0]
    proc = run_dtrain(["sample", str(run_dir), "--tokens", str(SAMPLE_TOKENS), "--seed", str(SEED)], check=True)
    words = "".join(proc.stdout.split())
    assert words and words in "".join(live.split()), (proc.stdout, live)


@pytest.mark.slow
def test_eval_of_the_checkpoint_scores_its_weights(moe_runs, tmp_path):
    run_dir, _ = moe_runs["compiled"]
    easy, hard = make_examples(corpus_text(), n_easy=4, n_hard=4)
    path = write_jsonl(tmp_path / "hellaswag.jsonl", easy + hard)
    run_dtrain(["eval", str(run_dir), f"eval.hellaswag.path={path}", "--out", str(tmp_path)], check=True)
    record = json.loads((tmp_path / "eval_hellaswag.json").read_text())
    model, cfg = model_from_run(run_dir)
    want = HellaSwagEval(read_examples(path), 0, 1, 8, cfg.model.block_size,
                         load_tokenizer(cfg.tokenizer)).evaluate(model, SINGLE)
    assert record["hellaswag_n"] == want.n == 8
    assert (record["hellaswag_correct"], record["hellaswag_correct_norm"]) == (want.correct, want.correct_norm)
