"""HellaSwag evaluation: file loading and errors, masking, accuracy on a trained tiny model, exact
agreement across world sizes (real gloo workers), the download path, and in-training logging."""

from __future__ import annotations

import functools
import http.server
import json
import random
import threading
from pathlib import Path

import pytest
import torch
from helpers.dtrain import REPO, corpus_text, dtrain_env, read_metrics, run_dtrain, tiny_args
from helpers.evals import make_examples, write_jsonl
from omegaconf import OmegaConf

from trainer.config.schema import HellaswagConfig, to_dict
from trainer.errors import DataError
from trainer.evals.hellaswag import HellaSwagEval, build_batch, encode_example, score_batch
from trainer.evals.hellaswag_file import Example, hellaswag_file, read_examples
from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT
from trainer.process.runtime import Runtime
from trainer.tokenizers.gpt2 import gpt2_encoding
from trainer.tokenizers.load import GPT2Tokenizer

SINGLE = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


def tiny_gpt(block_size: int = 64, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size)).eval()


# --- the file -------------------------------------------------------------------------------
def test_reads_examples_and_limit(tmp_path):
    exs = [Example(f"ctx {i}", ("a", "b", "c", "d"), i % 4) for i in range(5)]
    path = write_jsonl(tmp_path / "hs.jsonl", exs)
    assert read_examples(path) == exs
    assert read_examples(path, limit=2) == exs[:2]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 1', "line 3: not valid JSON"),
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"]}', "line 3: missing field 'label'"),
        ('{"endings": ["a", "b", "c", "d"], "label": 0}', "line 3: missing field 'ctx'"),
        ('{"ctx": "x", "endings": ["a", "b"], "label": 0}', "line 3: field 'endings' must be a list of 4"),
        ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 7}', "line 3: field 'label' must be"),
    ],
)
def test_bad_line_is_a_clear_error(tmp_path, bad_line, message):
    good = json.dumps({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n")
    with pytest.raises(DataError) as err:
        read_examples(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_local_path_checks(tmp_path):
    cfg = OmegaConf.structured(HellaswagConfig(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(DataError, match="is not a file"):
        hellaswag_file(cfg, str(tmp_path))
    path = write_jsonl(tmp_path / "hs.jsonl", [Example("c", ("a", "b", "c", "d"), 0)])
    cfg.path, cfg.sha256 = str(path), "0" * 64
    with pytest.raises(DataError, match="expected eval.hellaswag.sha256"):
        hellaswag_file(cfg, str(tmp_path))


class _Server:
    """A local HTTP server for one folder, counting the requests it answers."""

    def __init__(self, folder: Path):
        self.requests = 0
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                super().do_GET()

            def log_message(self, *args):
                pass

        handler = functools.partial(Handler, directory=str(folder))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_download_caches_and_verifies(tmp_path):
    import hashlib

    served = tmp_path / "served"
    served.mkdir()
    exs = [Example(f"ctx {i}", ("a", "b", "c", "d"), i % 4) for i in range(3)]
    body = write_jsonl(served / "hellaswag_val.jsonl", exs).read_bytes()
    digest = hashlib.sha256(body).hexdigest()
    data_dir = tmp_path / "data"
    server = _Server(served)
    try:
        cfg = OmegaConf.structured(HellaswagConfig(url=f"{server.url}/hellaswag_val.jsonl"))
        path = hellaswag_file(cfg, str(data_dir))
        assert path == data_dir / "hellaswag" / "hellaswag_val.jsonl"
        assert read_examples(path) == exs
        assert (data_dir / "hellaswag" / "hellaswag_val.jsonl.sha256").read_text().split()[0] == digest
        assert hellaswag_file(cfg, str(data_dir)) == path and server.requests == 1  # the cached copy

        path.write_text("corrupted\n")  # differs from the recorded sha256: fetched again
        assert read_examples(hellaswag_file(cfg, str(data_dir))) == exs and server.requests == 2

        cfg.sha256 = digest
        assert hellaswag_file(cfg, str(data_dir)) == path and server.requests == 2
        cfg.sha256 = "f" * 64
        with pytest.raises(DataError, match="expected eval.hellaswag.sha256"):
            hellaswag_file(cfg, str(data_dir))
        assert not path.exists()  # a copy that fails the check is not kept

        cfg.sha256, cfg.url = None, f"{server.url}/nothing_here.jsonl"
        with pytest.raises(DataError, match="cannot download HellaSwag .*eval.hellaswag.path"):
            hellaswag_file(cfg, str(data_dir))
    finally:
        server.close()


# --- scoring --------------------------------------------------------------------------------
def test_batch_layout_and_left_truncation():
    enc = GPT2Tokenizer()
    short = encode_example(Example("The cat sat", ("on the mat.", "up.", "down here now.", "x"), 0), enc)
    tokens, mask = build_batch([short], block_size=64)
    assert tokens.shape == (4, max(len(short.ctx) + len(e) for e in short.endings))
    assert mask.sum(1).tolist() == [len(e) for e in short.endings]  # ending tokens only
    for r, end in enumerate(short.endings):  # the masked targets are exactly the ending's tokens
        assert tokens[r, 1:][mask[r]].tolist() == end

    long_ctx = encode_example(Example(" ".join(["word"] * 100), ("a b c", "d", "e f", "g"), 1), enc)
    tokens, mask = build_batch([long_ctx], block_size=16)
    assert tokens.shape == (4, 16)  # truncated from the left
    for r, end in enumerate(long_ctx.endings):
        assert tokens[r, 1:][mask[r]].tolist() == end
        assert tokens[r, -len(end):].tolist() == end


def test_padding_never_changes_a_score():
    """An example scored alone and batched with longer ones gets the same losses."""
    enc = GPT2Tokenizer()
    model = tiny_gpt(block_size=64)
    rng = random.Random(1)
    words = "the king hath spoken and my lord shall come to the court of rome".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))
    small = encode_example(Example(text(3), (text(1), text(2), text(4), text(3)), 2), enc)
    longer = [encode_example(Example(text(30), tuple(text(12) for _ in range(4)), 0), enc) for _ in range(3)]
    alone_sum, alone_mean = score_batch(model, [small], 64)
    for batch, at in (([small, *longer], 0), ([*longer, small], 3), ([longer[0], small, longer[1]], 1)):
        sums, means = score_batch(model, batch, 64)
        torch.testing.assert_close(sums[at], alone_sum[0], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(means[at], alone_mean[0], rtol=1e-6, atol=1e-6)
        # and the longer examples' scores do not depend on the short one either
        other = [i for i in range(len(batch)) if i != at]
        ref_sums, _ = score_batch(model, [batch[i] for i in other], 64)
        torch.testing.assert_close(sums[other], ref_sums, rtol=1e-6, atol=1e-5)


def test_matches_the_reference_per_example_computation():
    """Batched, head-only scoring equals the reference's one-example-at-a-time formula."""
    import torch.nn.functional as F

    enc = GPT2Tokenizer()
    model = tiny_gpt(block_size=64)
    rng = random.Random(2)
    words = "to be or not that is the question whether tis nobler in the mind".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))
    exs = [Example(text(rng.randint(1, 20)), tuple(text(rng.randint(1, 8)) for _ in range(4)), 0)
           for _ in range(5)]
    sums, means = score_batch(model, [encode_example(e, enc) for e in exs], 64)
    for i, ex in enumerate(exs):
        ctx = gpt2_encoding().encode(ex.ctx)
        rows = [ctx + gpt2_encoding().encode(" " + e) for e in ex.endings]
        width = max(map(len, rows))
        tokens = torch.zeros((4, width), dtype=torch.long)
        mask = torch.zeros((4, width))
        for r, row in enumerate(rows):
            tokens[r, : len(row)] = torch.tensor(row)
            mask[r, len(ctx) : len(row)] = 1
        with torch.no_grad():
            logits = model(tokens)[0]
        losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                                 reduction="none").view(4, -1) * mask[:, 1:]
        torch.testing.assert_close(sums[i].float(), losses.sum(1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(means[i].float(), losses.sum(1) / mask[:, 1:].sum(1), rtol=1e-5, atol=1e-6)


class _CountingModel(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, idx):
        self.calls += 1
        return self.model(idx)


def test_every_rank_runs_the_same_number_of_forwards():
    """Uneven shares: the short ranks run dummy forwards (FSDP's collectives need every rank), and
    the per-rank counts add up to the single-process ones."""
    enc = GPT2Tokenizer()
    rng = random.Random(3)
    exs = [Example(f"ctx {i}", tuple(str(rng.random()) for _ in range(4)), rng.randint(0, 3))
           for i in range(11)]
    model = _CountingModel(tiny_gpt())
    whole = HellaSwagEval(exs, 0, 1, 2, 64, enc).evaluate(model, SINGLE)
    for world in (2, 3, 4):
        calls, correct, correct_norm, n = [], 0, 0, 0
        for rank in range(world):
            model.calls = 0
            part = HellaSwagEval(exs, rank, world, 2, 64, enc).evaluate(model, SINGLE)
            calls.append(model.calls)
            correct, correct_norm, n = correct + part.correct, correct_norm + part.correct_norm, n + part.n
        assert len(set(calls)) == 1, calls
        assert (correct, correct_norm, n) == (whole.correct, whole.correct_norm, whole.n)


@pytest.fixture(scope="module")
def trained_run(data_dir, tmp_path_factory):
    """A tiny GPT trained for 24 steps (4 x 64 tokens each) on the session corpus through the
    project's own Run, saved as a run dir (resolved config + state_dict), plus HellaSwag-format files
    for it. (10 steps already take the easy set from chance to 43/43.)"""
    from trainer.config.compose import compose
    from trainer.fit.run import Run
    from trainer.preflight.rundir import write_config_record

    root = tmp_path_factory.mktemp("hellaswag")
    run_dir = root / "run"
    overrides = [a for a in tiny_args(data_dir, run_dir) if "=" in a and not a.startswith("hydra.")]
    cfg = compose(overrides + ["train.max_steps=24", "optim.lr=3e-3", "data.val_fraction=0.1"])
    run = Run(cfg, SINGLE, run_dir)
    for step in range(cfg.train.max_steps):
        run.train_step(step)
    write_config_record(run_dir, to_dict(cfg))
    torch.save(run.model.state_dict(), run_dir / "model.pt")
    easy, hard = make_examples(corpus_text(), n_easy=43, n_hard=48)
    files = {"easy": write_jsonl(root / "easy.jsonl", easy), "hard": write_jsonl(root / "hard.jsonl", hard),
             "all": write_jsonl(root / "all.jsonl", easy + hard)}
    model = run.model.eval()
    return {"run_dir": run_dir, "cfg": cfg, "model": model, "files": files}


@pytest.mark.slow
def test_trained_model_tells_apart_what_it_can(trained_run):
    from trainer.model.gpt import build_model

    model, cfg = trained_run["model"], trained_run["cfg"]
    easy = HellaSwagEval(read_examples(trained_run["files"]["easy"]), 0, 1, 8, cfg.model.block_size)
    hard = HellaSwagEval(read_examples(trained_run["files"]["hard"]), 0, 1, 8, cfg.model.block_size)
    torch.manual_seed(cfg.train.seed)
    untrained = easy.evaluate(build_model(cfg.model), SINGLE)
    trained_easy, trained_hard = easy.evaluate(model, SINGLE), hard.evaluate(model, SINGLE)
    assert trained_easy.n == 43 and trained_hard.n == 48
    # the per-token figure (build-nanogpt's "acc_norm", named acc_per_token since issue 34)
    assert untrained.acc_per_token <= 0.45, untrained  # chance is 0.25: the ability comes from training
    assert trained_easy.acc_per_token >= 0.8, trained_easy
    assert 0.08 <= trained_hard.acc_per_token <= 0.45, trained_hard


def _eval_cli(trained_run, world: int, mode: str, torchrun: bool) -> dict:
    import subprocess
    import sys

    run_dir = trained_run["run_dir"]
    args = ["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}",
            f"eval.hellaswag.path={trained_run['files']['all']}", "eval.hellaswag.batch_examples=5",
            f"parallel={mode}"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "trainer", *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dtrain_env())
    else:
        proc = run_dtrain([*args, f"world={world}"])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads((run_dir / "eval_hellaswag.json").read_text())


@pytest.mark.slow
def test_same_counts_for_world_1_2_4(trained_run):
    """91 examples in batches of 5: at world 2 rank 1 runs a dummy forward (46 vs 45 examples), which
    FSDP needs to not hang; world 4 runs under plain torchrun."""
    results = {}
    for world, mode, torchrun in ((1, "none", False), (2, "fsdp", False), (4, "ddp", True)):
        r = _eval_cli(trained_run, world, mode, torchrun)
        assert (r["world"], r["parallel"]) == (world, mode)
        results[world] = (r["hellaswag_n"], r["hellaswag_correct"], r["hellaswag_correct_norm"],
                          r["hellaswag_acc"], r["hellaswag_acc_norm"])
    assert results[1][0] == 91
    assert results[1] == results[2] == results[4], results


@pytest.mark.slow
def test_eval_command_errors(trained_run, tmp_path):
    run_dir = trained_run["run_dir"]
    proc = run_dtrain(["eval", str(tmp_path)])
    assert proc.returncode == 2 and "not a dtrain run directory" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0}\nnot json\n')
    proc = run_dtrain(["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}", f"eval.hellaswag.path={bad}"])
    assert proc.returncode == 2 and "line 2: not valid JSON" in proc.stderr, proc.stderr
    proc = run_dtrain(["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}", "eval.nope=1"])
    assert proc.returncode == 2 and "bad override" in proc.stderr, proc.stderr


# --- during training ------------------------------------------------------------------------
@pytest.mark.slow
def test_logged_during_ddp_training_and_eval_of_its_checkpoint(data_dir, trained_run, tmp_path):
    """eval.hellaswag.interval under ddp world 2 logs the three keys every 10 steps and at the last; then
    `dtrain eval RUN_DIR` (no ckpt=: the newest checkpoint, written at the end of the run) scores
    the final weights on one process with exactly the counts logged at the last step."""
    run_dir = tmp_path / "run"
    hs = [f"eval.hellaswag.path={trained_run['files']['all']}", "eval.limit=20"]
    proc = run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=15",
                                "eval.hellaswag.interval=10", "eval.hellaswag.batch_examples=3", *hs))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    logged = [r for r in read_metrics(run_dir) if "hellaswag_acc" in r]
    assert [r["step"] for r in logged] == [10, 15]
    for r in logged:
        assert r["hellaswag_n"] == 20 and 0 <= r["hellaswag_acc"] <= 1 and 0 <= r["hellaswag_acc_norm"] <= 1

    proc = run_dtrain(["eval", str(run_dir), *hs])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    result = json.loads((run_dir / "eval_hellaswag.json").read_text())
    assert result["step"] == 15 and result["world"] == 1
    assert {k: result[k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")} == \
        {k: logged[-1][k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")}
    # the flags --tasks takes serve the built-in HellaSwag too: --step N, --limit N
    proc = run_dtrain(["eval", str(run_dir), "--step", "15", "--limit", "7", hs[0]])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    result = json.loads((run_dir / "eval_hellaswag.json").read_text())
    assert result["step"] == 15 and result["hellaswag_n"] == 7


def test_three_figures_under_three_names():
    """acc: lowest summed loss; acc_per_token: lowest mean loss per token (build-nanogpt's
    "acc_norm"); acc_norm: lowest summed loss per character of the ending (lm-evaluation-harness's
    acc_norm), each checked against its definition on endings of very different lengths."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=50304)).eval()
    enc = gpt2_encoding()
    examples = [Example("The cat sat on the", [e, "mat", "dog and the mouse ran away", "x"], label)
                for label, e in enumerate(["roof of the old house", "a", "hat", "mat mat mat"])]
    hs = HellaSwagEval(examples, 0, 1, 2, 64, enc=enc)
    result = hs.evaluate(model, SINGLE)
    sums, means = score_batch(model, [encode_example(ex, enc) for ex in examples], 64)
    chars = torch.tensor([[len(e) for e in ex.endings] for ex in examples], dtype=torch.float64)
    labels = torch.tensor([ex.label for ex in examples])
    assert result.correct == int((sums.argmin(1) == labels).sum())
    assert result.correct_per_token == int((means.argmin(1) == labels).sum())
    assert result.correct_norm == int(((-sums / chars).argmax(1) == labels).sum())  # the harness's ll / len
    assert set(result.metrics()) == {"hellaswag_acc", "hellaswag_acc_norm", "hellaswag_acc_per_token", "hellaswag_n"}
