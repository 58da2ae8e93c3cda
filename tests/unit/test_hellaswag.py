"""HellaSwag evaluation in-process: file loading and errors, masking, accuracy on a trained tiny model,
the download path, the three figures (across world sizes and during training, with real gloo
workers: tests/parallel/test_hellaswag_workers.py)."""

from __future__ import annotations

import functools
import http.server
import json
import random
import threading
from pathlib import Path

import pytest
import torch
from helpers.evals import write_jsonl
from omegaconf import OmegaConf

from trainer.config.schema import HellaswagConfig
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


@pytest.mark.slow
def test_trained_model_tells_apart_what_it_can(hellaswag_run):
    from trainer.model.gpt import build_model

    model, cfg = hellaswag_run["model"], hellaswag_run["cfg"]
    easy = HellaSwagEval(read_examples(hellaswag_run["files"]["easy"]), 0, 1, 8, cfg.model.block_size)
    hard = HellaSwagEval(read_examples(hellaswag_run["files"]["hard"]), 0, 1, 8, cfg.model.block_size)
    torch.manual_seed(cfg.train.seed)
    untrained = easy.evaluate(build_model(cfg.model), SINGLE)
    trained_easy, trained_hard = easy.evaluate(model, SINGLE), hard.evaluate(model, SINGLE)
    assert trained_easy.n == 43 and trained_hard.n == 48
    # the per-token figure (build-nanogpt's "acc_norm", named acc_per_token since issue 34)
    assert untrained.acc_per_token <= 0.45, untrained  # chance is 0.25: the ability comes from training
    assert trained_easy.acc_per_token >= 0.8, trained_easy
    assert 0.08 <= trained_hard.acc_per_token <= 0.45, trained_hard


# --- during training ------------------------------------------------------------------------


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


def test_each_figure_counts_the_ending_its_definition_picks():
    """Labels set to each figure's own pick make that figure 1 and its opposite pick 0: the counts
    of the test above can agree by chance (one right in four either way), these cannot."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=50304)).eval()
    enc = gpt2_encoding()
    examples = [Example("The cat sat on the", [e, "mat", "dog and the mouse ran away", "x"], 0)
                for e in ["roof of the old house", "a", "hat", "mat mat mat"]]
    sums, means = score_batch(model, [encode_example(ex, enc) for ex in examples], 64)
    chars = torch.tensor([[len(e) for e in ex.endings] for ex in examples], dtype=torch.float64)
    for figure, scores in (("correct", sums), ("correct_per_token", means), ("correct_norm", sums / chars)):
        for labels, expected in ((scores.argmin(1), len(examples)), (scores.argmax(1), 0)):
            labelled = [Example(ex.ctx, ex.endings, int(label)) for ex, label in zip(examples, labels)]
            result = HellaSwagEval(labelled, 0, 1, 2, 64, enc=enc).evaluate(model, SINGLE)
            assert getattr(result, figure) == expected, (figure, labels)
