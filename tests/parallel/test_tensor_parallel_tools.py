"""A tensor-parallel run's other paths (issue 47 item 3): activation checkpointing and the
non-finite guard while it trains, then KV-cache sampling, `dtrain eval` and `dtrain export` on its
checkpoint.

One shared TP run (parallel=none parallel.tp=2, world 2) trains with activation checkpointing on, a
NaN loss injected at step 6 and train.on_nonfinite=rollback, and samples at its end from its live
shards. Its one-process twin (no TP, no activation checkpointing, the same injection) is what its
losses must track. The commands then read its checkpoint in one process: `dtrain sample` must write
the sample the live TP model wrote, `dtrain eval` score what the checkpoint's weights score in this
process, `dtrain export` hold the checkpoint's weights (Hugging Face's GPT-2 computes the same logits).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import strict_metrics
from helpers.dtrain import corpus_text, inject, run_dtrain, tiny_args, train_losses
from helpers.evals import make_examples, write_jsonl
from helpers.runs import ONE_PROCESS, REFERENCE_BATCH, assert_matches_one_process

from trainer.evals.hellaswag import HellaSwagEval
from trainer.evals.hellaswag_file import read_examples
from trainer.process.runtime import Runtime
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.from_checkpoint import model_from_run

STEPS, BAD_STEP, SAMPLE_TOKENS, SEED = 8, 6, 24, 1337
COMMON = [*REFERENCE_BATCH, f"train.max_steps={STEPS}", "checkpoint.interval=4", "train.on_nonfinite=rollback",
          f"train.seed={SEED}"]
TP = ["parallel=none", "parallel.tp=2", "world=2", "train.micro_batch_size=2", "train.activation_checkpointing=true",
      f"train.sample_tokens={SAMPLE_TOKENS}"]
pytestmark = pytest.mark.slow  # the two training runs take ~50 s on 2 cores; each command ~10 s more
SINGLE = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


@pytest.fixture(scope="module")
def tp_run(data_dir, module_tmp):
    """(run dir, stdout) of the TP run, and the one-process twin's run dir."""
    root = module_tmp.mktemp("tp_tools")
    out = {}
    for name, extra in (("tp", TP), ("one", ONE_PROCESS)):
        proc = run_dtrain(tiny_args(data_dir, root / name, *COMMON, *extra), env=inject(BAD_STEP))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = root / name, proc.stdout
    return out


def _words(text: str) -> str:
    return "".join(text.split())


def test_activation_checkpointing_and_a_rollback_track_one_process(tp_run):
    (tp_dir, _), (one_dir, _) = tp_run["tp"], tp_run["one"]
    rollbacks = [r["rollback"] for r in strict_metrics(tp_dir) if "rollback" in r]
    assert [(r["from_step"], r["count"]) for r in rollbacks] == [(BAD_STEP, 1)]
    assert rollbacks[0]["checkpoint"].endswith("step_000004")
    # after the rollback both runs trained steps 5.. again from step 4's checkpoint, past the bad batch
    assert_matches_one_process(train_losses(one_dir), train_losses(tp_dir), STEPS, "tp=2 with activation checkpointing")


def test_sample_of_the_checkpoint_is_what_the_live_tp_model_wrote(tp_run):
    tp_dir, stdout = tp_run["tp"]
    live = stdout.split("sample:", 1)[1].split("run summary", 1)[0]
    proc = run_dtrain(["sample", str(tp_dir), "--tokens", str(SAMPLE_TOKENS), "--seed", str(SEED)], check=True)
    assert _words(proc.stdout) and _words(proc.stdout) in _words(live), (proc.stdout, live)


def test_eval_of_the_checkpoint_scores_its_weights(tp_run, tmp_path):
    tp_dir, _ = tp_run["tp"]
    easy, hard = make_examples(corpus_text(), n_easy=8, n_hard=8)
    path = write_jsonl(tmp_path / "hellaswag.jsonl", easy + hard)
    run_dtrain(["eval", str(tp_dir), f"eval.hellaswag.path={path}", "--out", str(tmp_path)], check=True)
    record = json.loads((tmp_path / "eval_hellaswag.json").read_text())
    model, cfg = model_from_run(tp_dir)
    want = HellaSwagEval(read_examples(path), 0, 1, 8, cfg.model.block_size,
                         load_tokenizer(cfg.tokenizer)).evaluate(model, SINGLE)
    assert record["hellaswag_n"] == want.n == 16
    assert (record["hellaswag_correct"], record["hellaswag_correct_norm"]) == (want.correct, want.correct_norm)


def test_export_holds_the_checkpoints_full_weights(tp_run, tmp_path):
    from transformers import GPT2LMHeadModel  # the optional export extra: only where it is used

    tp_dir, _ = tp_run["tp"]
    run_dtrain(["export", str(tp_dir), "--out", str(tmp_path / "hf")], check=True)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    model, _ = model_from_run(tp_dir)
    ids = torch.randint(0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[0]
        theirs = hf(ids).logits
    assert ours.shape[-1] >= theirs.shape[-1]
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, atol=1e-5, rtol=1e-5)
