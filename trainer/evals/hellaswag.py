"""HellaSwag: 4-way multiple choice, scored by the model's loss on each ending, sharded by rank.

The file (trainer/evals/hellaswag_file.py) is HellaSwag's public jsonl: a context, four endings and
the label of the right one. Scoring follows the
reference (build-nanogpt's hellaswag.py): each ending is tokenized with a leading space and
appended to the context; the model's per-token cross entropy over the ending tokens only gives
three figures, each under a name that says what it is:

    acc            the ending with the lowest summed loss (the harness's `acc` too)
    acc_per_token  the lowest mean loss per token: what build-nanogpt reports as "acc_norm"
    acc_norm       the lowest summed loss per character of the ending: lm-evaluation-harness's
                   definition of acc_norm (its log-likelihood over the choice's length)

so one name never means two numbers beside `dtrain eval --tasks hellaswag`.

Distribution: example i is scored by data-parallel rank i % dp_world; every rank runs the same number of forwards
(dummy ones when its share has run out, so FSDP's collectives never hang), and the correct/total
counts are summed over ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.errors import ConfigError, DataError
from trainer.evals.hellaswag_file import N_ENDINGS, Example, hellaswag_file, read_examples
from trainer.tokenizers.load import GPT2Tokenizer


@dataclass(frozen=True)
class EncodedExample:
    ctx: list[int]
    endings: list[list[int]]  # each ending's tokens, encoded with its leading space
    label: int
    ending_chars: tuple[int, ...] = ()  # each ending's length in characters (acc_norm's divisor)


# ------------------------------------------------------------------------------------ scoring


def encode_example(ex: Example, enc) -> EncodedExample:
    """Context and endings as the run's tokens (`enc`: a trainer/tokenizers/load.py tokenizer); each
    ending gets a leading space, as the reference does.

    An empty context becomes the end-of-text token, so that every ending token has something before
    it to be predicted from.
    """
    ctx = [int(i) for i in enc.encode(ex.ctx)] or [enc.eot]
    return EncodedExample(ctx, [[int(i) for i in enc.encode(" " + e)] for e in ex.endings], ex.label,
                          tuple(max(1, len(e)) for e in ex.endings))


def build_batch(batch: list[EncodedExample], block_size: int, device=None):
    """Tokens (R, L) and the target mask (R, L-1) for R = 4 x len(batch) rows.

    Row r is context + ending r % 4, truncated from the left to block_size and right-padded to the
    longest row. mask[r, j] is True where target tokens[r, j + 1] is an ending token.
    """
    rows = [ex.ctx + end for ex in batch for end in ex.endings]
    lens = torch.tensor([min(len(r), block_size) for r in rows])
    n_end = torch.tensor([len(end) for ex in batch for end in ex.endings])
    n_end = torch.minimum(n_end, lens - 1)  # position 0 is never a target
    flat = torch.tensor([t for r in rows for t in r[-block_size:]], dtype=torch.long)
    n_rows, width = len(rows), int(lens.max())
    row_of = torch.repeat_interleave(torch.arange(n_rows), lens)
    starts = torch.cumsum(lens, 0) - lens
    col_of = torch.arange(flat.numel()) - torch.repeat_interleave(starts, lens)
    tokens = torch.zeros((n_rows, width), dtype=torch.long)
    tokens[row_of, col_of] = flat
    j = torch.arange(width - 1)
    mask = (j >= (lens - n_end - 1)[:, None]) & (j < (lens - 1)[:, None])
    return tokens.to(device), mask.to(device)


@contextlib.contextmanager
def _head_only_at(model, rows: torch.Tensor, cols: torch.Tensor):
    """Make the model's output projection (lm_head) run on the hidden states at (rows, cols) only.

    The vocabulary projection is most of a small model's forward and a fifth of GPT-2 124M's;
    only the positions that predict an ending token need it. A forward pre-hook on lm_head keeps
    the model's own forward (and FSDP's hooks around it) unchanged; the forward then returns
    logits of shape (len(rows), vocab) instead of (R, L, vocab).
    """
    head = getattr(model, "lm_head", None)
    if head is None:
        yield False
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0][rows, cols], *args[1:]))
    try:
        yield True
    finally:
        handle.remove()


@torch.no_grad()
def score_batch(model, batch: list[EncodedExample], block_size: int, device=None):
    """(sum_loss, mean_loss), each (len(batch), 4): the cross entropy summed / averaged over
    each ending's tokens."""
    tokens, mask = build_batch(batch, block_size, device)
    targets = tokens[:, 1:][mask]
    rows, cols = mask.nonzero(as_tuple=True)  # row-major, the order of targets
    with _head_only_at(model, rows, cols) as selected:
        logits, _ = model(tokens)
    if not selected:
        logits = logits[:, :-1][mask]
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    losses = torch.zeros(mask.shape, dtype=torch.float64, device=tokens.device)
    losses[mask] = ce.double()
    sums = losses.sum(dim=1)
    means = sums / mask.sum(dim=1)
    return sums.view(-1, N_ENDINGS), means.view(-1, N_ENDINGS)


@dataclass
class HellaSwagResult:
    correct: int  # lowest summed loss is the label
    correct_per_token: int  # lowest mean loss per token is the label (build-nanogpt's "acc_norm")
    correct_norm: int  # lowest summed loss per character is the label (the harness's acc_norm)
    n: int

    @property
    def acc(self) -> float:
        return self.correct / self.n if self.n else math.nan

    @property
    def acc_per_token(self) -> float:
        return self.correct_per_token / self.n if self.n else math.nan

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.n if self.n else math.nan

    def metrics(self) -> dict:
        return {"hellaswag_acc": self.acc, "hellaswag_acc_norm": self.acc_norm,
                "hellaswag_acc_per_token": self.acc_per_token, "hellaswag_n": self.n}


class HellaSwagEval:
    """This rank's share of the examples (i % world == rank), tokenized once; evaluate() scores it."""

    def __init__(self, examples: list[Example], rank: int, world: int, batch_examples: int, block_size: int,
                 enc=None):
        if batch_examples < 1:
            raise ConfigError(f"eval.hellaswag.batch_examples={batch_examples} must be at least 1")
        if enc is None:
            enc = GPT2Tokenizer()
        self.n_total = len(examples)
        self.rank, self.world = rank, world
        self.batch_examples = batch_examples
        self.block_size = block_size
        self.encoded = [encode_example(ex, enc) for ex in examples[rank::world]]
        # Every rank runs this many forwards: the largest share's batches.
        self.n_batches = math.ceil(math.ceil(self.n_total / world) / batch_examples)

    @classmethod
    def from_config(cls, cfg, rt, tokenizer) -> HellaSwagEval:
        """Rank 0 finds (downloads) and reads the file and shares the examples with every rank;
        `tokenizer` encodes them (the run's: trainer/tokenizers/load.py)."""
        limit = cfg.eval.limit
        if limit is not None and limit < 1:
            raise ConfigError(f"eval.limit={limit} must be at least 1 (or null for all examples)")
        examples = rt.from_main(lambda: read_examples(hellaswag_file(cfg.eval.hellaswag, cfg.data.dir), limit),
                                error=DataError)
        return cls(examples, rt.dp_rank, rt.dp_world,
                   cfg.eval.hellaswag.batch_examples, cfg.model.block_size, tokenizer)

    @property
    def n_local(self) -> int:
        return len(self.encoded)

    @torch.no_grad()
    def evaluate(self, model, rt, autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 progress: Callable[[int], None] | None = None) -> HellaSwagResult:
        """Score this rank's share with `model` (every rank must call this), sum the counts over
        ranks and return them. `progress(k)` is called after each batch with its example count."""
        autocast = autocast or contextlib.nullcontext
        device = rt.device
        was_training = model.training
        model.eval()
        correct, correct_per_token, correct_norm = (torch.zeros((), dtype=torch.long, device=device)
                                                    for _ in range(3))
        B = self.batch_examples
        try:
            for b in range(self.n_batches):
                batch = self.encoded[b * B : (b + 1) * B]
                with autocast():
                    if not batch:
                        # This rank's share ran out: a one-token forward keeps it in step with the
                        # others (with FSDP every forward is a collective).
                        model(torch.zeros((1, 1), dtype=torch.long, device=device))
                        continue
                    sums, means = score_batch(model, batch, self.block_size, device)
                labels = torch.tensor([ex.label for ex in batch], device=device)
                chars = torch.tensor([ex.ending_chars for ex in batch], dtype=sums.dtype, device=device)
                correct += (sums.argmin(dim=1) == labels).sum()
                correct_per_token += (means.argmin(dim=1) == labels).sum()
                correct_norm += ((sums / chars).argmin(dim=1) == labels).sum()
                if progress is not None:
                    progress(len(batch))
        finally:
            model.train(was_training)
        local = torch.stack([correct, correct_per_token, correct_norm, torch.tensor(self.n_local, device=device)])
        # The ranks of one tensor-parallel group scored the same share: count it once.
        total = rt.all_reduce_sum(local) // rt.shape.model_parallel
        return HellaSwagResult(*(int(t) for t in total.tolist()))
