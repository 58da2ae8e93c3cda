"""EleutherAI's lm-evaluation-harness on a dtrain GPT: the harness's LM interface over our model and
tiktoken's GPT-2 encoding, so a checkpoint is scored without a Hugging Face conversion.

The request handling follows the harness's own `hf` model (lm_eval/models/huggingface.py, HFLM) step
by step, so the same weights give the same numbers through either: requests sorted longest first
and batched by the harness's Collator (one forward for continuations that share a context),
contexts truncated from the left to the model's block size, right padding (causal attention keeps
it out of every scored position), log-softmax over the real vocabulary; rolling loglikelihoods in
the harness's disjoint windows; greedy generation that stops at `until`, <|endoftext|> or
max_gen_toks. Imports lm_eval at the top: the eval command imports this module only for --tasks.
"""

from __future__ import annotations

import time
from collections import Counter

import lm_eval
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager

from trainer.data.tokenizer import EOT, gpt2_encoding
from trainer.errors import ConfigError, UserError
from trainer.io import first_line

HARNESS_VERSION = lm_eval.__version__


class DtrainLM(TemplateLM):
    """A plain (unwrapped) dtrain GPT as a harness model; `requests` counts what it scored. The
    harness's progress-bar options (disable_tqdm) arrive in **kwargs: no bars here."""

    backend = "causal"

    def __init__(self, model: torch.nn.Module, batch_size: int = 8, device: str | torch.device = "cpu",
                 max_gen_toks: int = 256):
        super().__init__()
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.enc = gpt2_encoding()
        self.batch_size = batch_size
        self.max_length = model.config.block_size
        self.max_gen_toks = max_gen_toks
        self.requests: Counter[str] = Counter()

    @property
    def eot_token_id(self) -> int:
        return EOT

    @property
    def tokenizer_name(self) -> str:
        return "gpt2"

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        # <|endoftext|> written in a prompt is the special token, as the GPT-2 tokenizer of transformers
        # reads it; GPT-2 adds no BOS, so add_special_tokens (in kwargs) changes nothing.
        return self.enc.encode(string, allowed_special="all")

    def tok_decode(self, tokens: list[int]) -> str:
        return self.enc.decode(tokens)

    @torch.inference_mode()
    def _log_probs(self, batch: torch.Tensor) -> torch.Tensor:
        logits, _ = self.model(batch)  # the real vocabulary only: padded rows are cut off
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, override_bs: int | None = None, **kwargs):
        """[(logprob, is_greedy)] of (strings, context ids, continuation ids) requests (HFLM's batching)."""
        self.requests["loglikelihood"] += len(requests)

        def longest_first(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        reorder = Collator(requests, sort_fn=longest_first, group_by="contexts",
                           group_fn=lambda req: req[-2] + req[-1][:-1])
        res = []
        for chunk in reorder.get_batched(n=override_bs or self.batch_size):
            # The input is context + continuation minus its last token, at most max_length from the right.
            inps = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            width = max(len(x) for x in inps)
            batch = torch.zeros(len(inps), width, dtype=torch.long)
            for i, inp in enumerate(inps):
                batch[i, : len(inp)] = torch.tensor(inp, dtype=torch.long)
            log_probs = self._log_probs(batch.to(self._device))
            for (request, ctx, cont), inp, row in zip(chunk, inps, log_probs):
                row = row[len(inp) - len(cont): len(inp)].unsqueeze(0)  # the continuation's positions
                greedy = row.argmax(dim=-1)
                # Requests whose context + continuation[:-1] is this one's share its forward.
                for strings, cont_toks, logits in reorder.get_cache(req_str=request, cxt_toks=ctx,
                                                                    cont_toks=cont, logits=row):
                    target = torch.tensor(cont_toks, dtype=torch.long, device=self._device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -target.shape[1]:] == target).all())
                    logprob = float(torch.gather(logits, 2, target.unsqueeze(-1)).sum())
                    res.append((logprob, is_greedy))
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, (logprob, is_greedy))
        return reorder.get_original(res)

    def loglikelihood_rolling(self, requests, **kwargs) -> list[float]:
        """Log-likelihood of whole documents: each token predicted once, in max_length windows whose
        first one starts after <|endoftext|>, batched in request order as HFLM does."""
        self.requests["loglikelihood_rolling"] += len(requests)
        windows, counts = [], []
        for (string,) in (req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=EOT,
                                                         max_seq_len=self.max_length, context_len=1)
            doc = [(None, *lm_utils.make_disjoint_window(w)) for w in rolling]
            windows += doc
            counts.append(len(doc))
        scores = []
        for i in range(0, len(windows), self.batch_size):
            batch = windows[i: i + self.batch_size]
            scores += [logprob for logprob, _ in self._loglikelihood_tokens(batch, override_bs=len(batch))]
        out, at = [], 0
        for req, n in zip(requests, counts):
            out.append(sum(scores[at: at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    def generate_until(self, requests, **kwargs) -> list[str]:
        """Greedy continuations, longest context first, batched per generation settings."""
        self.requests["generate_until"] += len(requests)
        reorder = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                           group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos = self.tok_decode([EOT])
        res = []
        for chunk in reorder.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError(f"a task asks for sampled generation ({all_kwargs[0]}); dtrain's harness model "
                                  "decodes greedily: choose a task that generates with do_sample: false")
            if max_gen_toks >= self.max_length:
                raise ConfigError(f"a task generates up to {max_gen_toks} tokens, which leaves no room for its "
                                  f"prompt in this model's block size of {self.max_length} tokens")
            prompts = [self.tok_encode(c)[-(self.max_length - max_gen_toks):] for c in contexts]
            texts = self._greedy(prompts, max_gen_toks, until)
            for context, gen_kwargs, text in zip(contexts, all_kwargs, texts):
                text = postprocess_generated_text(text, stop=until, think_end_token=None)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return reorder.get_original(res)

    @torch.inference_mode()
    def _greedy(self, prompts: list[list[int]], max_gen_toks: int, until: list[str]) -> list[str]:
        """Greedy text after each prompt, all rows in one batch: right-padded, each row's next token
        read at its own last position (causal attention keeps the padding after it out, so no mask
        is needed) and written after it; a row stops at <|endoftext|> or once a stop string appears."""
        lengths = torch.tensor([len(p) for p in prompts], device=self._device)
        rows = torch.arange(len(prompts), device=self._device)
        buf = torch.zeros(len(prompts), int(lengths.max()) + max_gen_toks, dtype=torch.long, device=self._device)
        for r, prompt in enumerate(prompts):
            buf[r, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        generated: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_gen_toks):
            logits, _ = self.model(buf[:, : int(lengths.max())], logits_at=lengths - 1)
            next_ids = logits[:, 0].argmax(dim=-1)
            buf[rows, lengths] = next_ids
            lengths += 1
            for r, token in enumerate(next_ids.tolist()):
                if done[r]:
                    continue
                if token == EOT:
                    done[r] = True
                    continue
                generated[r].append(token)
                done[r] = any(stop and stop in self.tok_decode(generated[r]) for stop in until)
            if all(done):
                break
        return [self.tok_decode(g) for g in generated]


def task_manager(include_path: str | None) -> TaskManager:
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], manager: TaskManager) -> None:
    """Every requested name must be a task, group or tag the harness (or --include-path) knows."""
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ConfigError(f"unknown harness task(s) {', '.join(unknown)}; `lm-eval ls tasks` lists the built-in "
                          "ones, and --include-path DIR adds a folder of task YAMLs")


def evaluate(lm: DtrainLM, tasks: list[str], manager: TaskManager, limit: float | None = None,
             num_fewshot: int | None = None, bootstrap_iters: int = 100000) -> tuple[dict, float]:
    """(the harness's result dict, seconds spent) for `tasks` scored with `lm`."""
    t0 = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=False)
    except ConnectionError as err:  # `datasets` could not fetch a task's data (no network, HF_HUB_OFFLINE=1)
        raise UserError(f"the harness could not fetch a task's data: {first_line(err)}; it downloads from the "
                        "Hugging Face Hub into ~/.cache/huggingface, so allow network access once "
                        "(or use local task YAMLs with --include-path)") from None
    return results, time.perf_counter() - t0
