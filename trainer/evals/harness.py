"""EleutherAI's lm-evaluation-harness on a dtrain GPT: the harness's LM interface over our model and
tiktoken's GPT-2 encoding, so a checkpoint is scored without a Hugging Face conversion.

The request handling follows the harness's own `hf` model (lm_eval/models/huggingface.py, HFLM), so
the same weights give the same numbers through either: requests sorted longest first and batched,
requests with the same input sharing one forward, contexts truncated from the left to the model's
block size, right padding (causal attention keeps it out of every scored position), log-softmax
over the real vocabulary at the continuation's positions only; rolling loglikelihoods in the
harness's disjoint windows; generation with the KV cache (left-padded batches), greedy unless the
task samples, stopping at `until`, <|endoftext|> or max_gen_toks. With a `dealer` over N workers
(`dtrain eval ... world=N`) each batch is scored on one of them and every worker gets all results
(trainer/evals/dealing.py). Imports lm_eval at the top: the eval command imports this module only
for --tasks.
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections import Counter
from pathlib import Path

import lm_eval
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager, get_task_dict

from trainer.errors import ConfigError, UserError
from trainer.evals.dealing import Dealer
from trainer.evals.task_data import not_cached
from trainer.io import first_line, write_atomic
from trainer.model.decode import Sampling, generate
from trainer.tokenizers.load import GPT2Tokenizer

HARNESS_VERSION = lm_eval.__version__
# What generate_until understands of a task's generation_kwargs (after the harness normalized them).
GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}

def served(kind: str):
    """Count a request method's requests under `kind` and add the time it takes to `seconds[kind]`."""
    def wrap(method):
        @functools.wraps(method)
        def counted(self, requests, **kwargs):
            self.requests[kind] += len(requests)
            t0 = time.perf_counter()
            try:
                return method(self, requests, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t0
        return counted
    return wrap


class DtrainLM(TemplateLM):
    """A plain (unwrapped) dtrain GPT as a harness model; `requests` counts what it scored and
    `seconds` the time spent in each kind of request (the model's share of the harness's wall). The
    harness's progress-bar options (disable_tqdm) arrive in **kwargs: no bars here. `seed` seeds
    each sampled generation by its request, so samples do not depend on batching or world size."""

    backend = "causal"

    def __init__(self, model: torch.nn.Module, batch_size: int = 8, device: str | torch.device = "cpu",
                 max_gen_toks: int = 256, dealer: Dealer | None = None, seed: int = 1234, tokenizer=None):
        super().__init__()
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.enc = tokenizer or GPT2Tokenizer()  # the run's (trainer/tokenizers/load.py)
        self.batch_size = batch_size
        self.max_length = model.config.block_size
        self.max_gen_toks = max_gen_toks
        self.dealer = dealer or Dealer()
        self.seed = seed
        self.requests: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    @property
    def eot_token_id(self) -> int:
        return self.enc.eot

    @property
    def tokenizer_name(self) -> str:
        return self.enc.name if self.enc.name == "gpt2" else f"{self.enc.name}-{self.enc.fingerprint}"

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        # a special token written in a prompt is that token, as transformers' tokenizer reads it;
        # no BOS is added (GPT-2 adds none), so add_special_tokens (in kwargs) changes nothing.
        return self.enc.encode_prompt(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.enc.decode(tokens)

    # --------------------------------------------------------------------- loglikelihood

    @served("loglikelihood")
    def _loglikelihood_tokens(self, requests, **kwargs):
        """[(logprob, is_greedy)] of (strings, context ids, continuation ids) requests: the input is
        context + continuation minus its last token, at most max_length from the right; requests
        with the same input share its forward (HFLM's one-token-continuation cache, for any length)."""
        readers: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for index, (_, ctx, cont) in enumerate(requests):
            readers.setdefault(tuple((ctx + cont)[-(self.max_length + 1):][:-1]), []).append((index, cont))
        inputs = sorted(readers, key=lambda inp: (-len(inp), inp))
        batches = [[(list(inp), readers[inp]) for inp in inputs[i: i + self.batch_size]]
                   for i in range(0, len(inputs), self.batch_size)]
        res: list = [None] * len(requests)
        for index, scored in self.dealer.map(batches, self._score_batch):
            res[index] = scored
        for (strings, _, _), scored in zip(requests, res):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, scored)
        return res

    @torch.inference_mode()
    def _score_batch(self, rows: list[tuple[list[int], list[tuple[int, list[int]]]]]):
        """[(request index, (logprob, is_greedy))] for a batch of inputs, each with the requests
        (index, continuation) read from it. Logits only at the last K positions of each row, K the
        longest continuation: the output head and the softmax skip the context."""
        width = max(len(inp) for inp, _ in rows)
        k = min(width, max(len(cont) for _, readers in rows for _, cont in readers))
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        ends = torch.tensor([len(inp) for inp, _ in rows])
        for r, (inp, _) in enumerate(rows):
            batch[r, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        at = (ends.unsqueeze(1) - k + torch.arange(k)).clamp(min=0)
        logits, _ = self.model(batch.to(self._device), logits_at=at.to(self._device))
        log_probs = F.log_softmax(logits.float(), dim=-1)  # the real vocabulary only: padded rows cut off
        greedy = log_probs.argmax(dim=-1).tolist()  # one call for the batch, not one per request
        out = []
        for (_, readers), row, row_greedy in zip(rows, log_probs, greedy):
            for index, cont in readers:
                part = row[k - len(cont):]
                target = torch.tensor(cont, dtype=torch.long, device=self._device)
                is_greedy = row_greedy[k - len(cont):] == cont
                out.append((index, (float(part.gather(1, target.unsqueeze(1)).sum()), is_greedy)))
        return out

    @served("loglikelihood_rolling")
    def loglikelihood_rolling(self, requests, **kwargs) -> list[float]:
        """Log-likelihood of whole documents: each token predicted once, in max_length windows whose
        first one starts after <|endoftext|>, batched in request order as HFLM does."""
        windows, counts = [], []
        for (string,) in (req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.enc.eot,
                                                         max_seq_len=self.max_length, context_len=1)
            doc = [lm_utils.make_disjoint_window(w) for w in rolling]
            windows += doc
            counts.append(len(doc))
        self.requests["loglikelihood"] += len(windows)  # each window is one, as in HFLM
        rows = [((ctx + cont)[-(self.max_length + 1):][:-1], [(i, cont)]) for i, (ctx, cont) in enumerate(windows)]
        batches = [rows[i: i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        scores = [scored[0] for _, scored in sorted(self.dealer.map(batches, self._score_batch))]
        out, at = [], 0
        for req, n in zip(requests, counts):
            out.append(sum(scores[at: at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    # ---------------------------------------------------------------------- generation

    @served("generate_until")
    def generate_until(self, requests, **kwargs) -> list[str]:
        """Continuations batched per generation settings, longest context first."""
        args = [req.args for req in requests]
        seen: Counter[str] = Counter()
        seeds = []
        for context, _ in args:  # a repeated request (repeats: N) draws other samples each time
            seeds.append((self.seed * 1_000_003 + zlib.crc32(context.encode()) * 7919 + seen[context]) % 2**62)
            seen[context] += 1
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        batches = []
        for indices in groups.values():
            settings = self._settings(args[indices[0]][1])
            prompts = {i: self.tok_encode(args[i][0])[-(self.max_length - settings[1]):] for i in indices}
            indices.sort(key=lambda i: (-len(self.tok_encode(args[i][0])), args[i][0]))
            batches += [[(i, prompts[i], seeds[i], settings) for i in indices[j: j + self.batch_size]]
                        for j in range(0, len(indices), self.batch_size)]
        res: list = [None] * len(requests)
        for index, text in self.dealer.map(batches, self._generate_batch):
            res[index] = text
        for (context, gen_kwargs), text in zip(args, res):
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return res

    def _settings(self, gen_kwargs: dict) -> tuple[list[str], int, Sampling]:
        """(stop strings, max_gen_toks, sampling) of a task's generation_kwargs."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        unknown = sorted(set(kwargs) - GEN_KEYS)
        if unknown:
            raise ConfigError(f"a task's generation_kwargs has {', '.join(unknown)}, which dtrain's harness model "
                              f"does not apply; it takes {', '.join(sorted(GEN_KEYS))}")
        until = handle_stop_sequences(kwargs["until"], eos=self.tok_decode([self.enc.eot]))
        max_gen_toks = kwargs["max_gen_toks"]
        if max_gen_toks >= self.max_length:
            raise ConfigError(f"a task generates up to {max_gen_toks} tokens, which leaves no room for its "
                              f"prompt in this model's block size of {self.max_length} tokens")
        sampling = Sampling()
        if kwargs.get("do_sample"):
            top_k = kwargs.get("top_k")
            sampling = Sampling(float(kwargs.get("temperature") or 1.0), int(top_k) if top_k else None,
                                kwargs.get("top_p"))
        return until, max_gen_toks, sampling

    @torch.inference_mode()
    def _generate_batch(self, rows) -> list[tuple[int, str]]:
        """[(request index, text)] for one batch of (index, prompt ids, seed, settings): decoded
        with the KV cache, each row stopping at <|endoftext|> or once a stop string appears, and
        cut before the first stop string."""
        until, max_gen_toks, sampling = rows[0][3]
        generators = None
        if not sampling.greedy:
            generators = [torch.Generator(device=self._device).manual_seed(seed) for _, _, seed, _ in rows]

        def stop(new: list[int]) -> bool:
            text = self.tok_decode(new)
            return any(s and s in text for s in until)

        new = generate(self.model, [prompt for _, prompt, _, _ in rows], max_gen_toks, sampling, generators,
                       eot=self.enc.eot, stop=stop)
        return [(index, postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None))
                for (index, _, _, _), tokens in zip(rows, new)]


def check_tasks(tasks: list[str], manager: TaskManager) -> None:
    """Every requested name must be a task, group or tag the harness (or --include-path) knows."""
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ConfigError(f"unknown harness task(s) {', '.join(unknown)}; `lm-eval ls tasks` lists the built-in "
                          "ones, and --include-path DIR adds a folder of task YAMLs")


def load_tasks(tasks: list[str], manager: TaskManager, offline: str) -> None:
    """Build the tasks, which loads their data: with the Hub out of reach (`offline` says why, and
    its clients are set offline), from the cache or a UserError at once."""
    try:
        get_task_dict(tasks, manager)
    except ConnectionError:
        raise UserError(not_cached(offline)) from None


def evaluate(lm: DtrainLM, tasks: list[str], manager: TaskManager, limit: float | None = None,
             num_fewshot: int | None = None, bootstrap_iters: int = 100000,
             log_samples: bool = False) -> tuple[dict, float]:
    """(the harness's result dict, seconds spent) for `tasks` scored with `lm`; with `log_samples`
    the dict has the harness's per-request records under "samples"."""
    t0 = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, bootstrap_iters=bootstrap_iters,
                                          log_samples=log_samples)
    except ConnectionError as err:  # `datasets` could not fetch a task's data (no network, HF_HUB_OFFLINE=1)
        raise UserError(f"the harness could not fetch a task's data: {first_line(err)}; it downloads from the "
                        "Hugging Face Hub into ~/.cache/huggingface, so allow network access once "
                        "(or use local task YAMLs with --include-path)") from None
    return results, time.perf_counter() - t0


def write_samples(results: dict, run_dir: Path) -> dict[str, Path]:
    """<run_dir>/eval_samples_<task>.jsonl for each task: one line per document, the record the
    harness's own --log_samples writes (EvaluationTracker.save_results_samples: arguments as
    gen_args_i / arg_j, responses sanitized, target as text), so the files compare line by line."""
    paths = {}
    for task, samples in results.get("samples", {}).items():
        lines = []
        for sample in samples:
            sample = dict(sample)
            sample["arguments"] = {f"gen_args_{i}": {f"arg_{j}": value for j, value in enumerate(arg)}
                                   for i, arg in enumerate(sample["arguments"])}
            sample["resps"] = lm_utils.sanitize_list(sample["resps"])
            sample["filtered_resps"] = lm_utils.sanitize_list(sample["filtered_resps"])
            sample["target"] = str(sample["target"])
            lines.append(json.dumps(sample, default=lm_utils.handle_non_serializable, ensure_ascii=False) + "\n")
        paths[task] = run_dir / f"eval_samples_{task}.jsonl"
        write_atomic(paths[task], "".join(lines))
    return paths
