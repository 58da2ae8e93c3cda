"""lm-evaluation-harness throughput (requests/s): dtrain's adapter against the harness's `hf` model.

    .venv/bin/python scripts/bench_harness.py [--models cpu_small gpt2_124m] [--batch-size 8] [--examples 48]
                                              [--device cpu] [--threads N] [--repeats 3] [--worlds 1 2]
                                              [--end-to-end 48]

For each model size, random-init weights (seed 0) go to dtrain's harness model
(trainer/evals/harness.py: DtrainLM over our GPT) and, written out as `dtrain export` writes them
(safetensors, config.json, the GPT-2 tokenizer files), to the harness's own HFLM (float32, the same
batch size). Both score the same three local tasks (offline: jsonl files from tiny-shakespeare text,
or generated text): multiple choice (4 loglikelihood requests an example), rolling loglikelihood
(documents of ~1000 characters) and greedy generation (until a newline, at most 16 tokens). The
clock covers only the model's calls (loglikelihood, loglikelihood_rolling, generate_until), after
one warm-up pass of both, and the best of --repeats passes counts (the machine may be shared);
the harness's own work around them (datasets, metrics) is the same for both. The table also says
whether every metric agreed (within 1e-6 relative).

The second table is `dtrain eval RUN --tasks T world=N` itself, one task at a time, for each of
--worlds (N workers of --threads / N threads each, and one worker of as many, to tell how well the
requests split from how many cores there are): the same weights saved as a run
(resolved_config.json and a state_dict), requests/s counted over the model's calls
(eval_harness.json's model_s: on rank 0, waiting for the other workers included), the best of
--repeats, and whether each setup's metrics equal world 1's exactly.

The third table (--end-to-end N) times whole commands as a user runs them, start-up included:
`dtrain eval RUN --tasks bench_gen_e2e` (N greedy generations) against `lm_eval --model hf` on the
export, taking turns, the best of --repeats wall times each, and counts the requests whose logged
outputs (resps, filtered_resps of --log-samples / --log_samples) are equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")  # local task files and a local model folder: nothing to fetch

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lm_eval  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from trainer.config.compose import compose  # noqa: E402
from trainer.config.schema import to_dict  # noqa: E402
from trainer.evals.harness import DtrainLM  # noqa: E402
from trainer.evals.task_index import task_manager  # noqa: E402
from trainer.huggingface.mapping import hf_config, to_hf_state_dict  # noqa: E402
from trainer.model.gpt import build_model  # noqa: E402
from trainer.preflight.rundir import write_config_record  # noqa: E402
from trainer.tokenizers.hf_files import hf_tokenizer_files, write_hf_tokenizer  # noqa: E402

CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
TASKS = {"bench_mc": "loglikelihood", "bench_ppl": "loglikelihood_rolling", "bench_gen": "generate_until"}
E2E_TASK = "bench_gen_e2e"  # bench_gen's kind of generation, --end-to-end requests of it


def paragraphs(n: int) -> list[str]:
    if CORPUS.exists():
        paras = [p.strip() for p in CORPUS.read_text().split("\n\n") if len(p.strip()) > 150]
    else:
        import random

        rng = random.Random(0)
        words = "the king hath spoken and my lord shall come to the court of rome where all cry".split()
        paras = ["\n".join(" ".join(rng.choice(words) for _ in range(9)) for _ in range(5)) for _ in range(4 * n)]
    return paras[: 4 * n]


def write_tasks(root: Path, n: int, n_gen_e2e: int = 0) -> None:
    paras = paragraphs(n)
    mc = []
    for i in range(n):
        words = paras[i].split()
        right = " ".join(words[10:18])
        choices = [right] + [" ".join(paras[(i + k) % len(paras)].split()[10:18]) for k in (1, 2, 3)]
        choices = choices[i % 4:] + choices[: i % 4]
        mc.append({"question": " ".join(words[:10]), "choices": choices, "label": choices.index(right)})
    docs = [{"text": "\n\n".join(paras[i: i + 4])[:1000]} for i in range(0, n // 2)]
    gen = [{"question": p[:150], "answer": p[150:170]} for p in paras[n: n + n // 2]]
    gen_e2e = [{"question": p[:150], "answer": p[150:170]} for p in paras[n: n + n_gen_e2e]]
    yaml = {
        "bench_mc": ("mc", 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                           'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'),
        "bench_ppl": ("docs", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                              "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
        "bench_gen": ("gen", 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
                             'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
                             "metric_list:\n  - metric: exact_match\n"),
    }
    yaml[E2E_TASK] = ("gen_e2e", yaml["bench_gen"][1])
    for name, rows in (("mc", mc), ("docs", docs), ("gen", gen), ("gen_e2e", gen_e2e)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for task, (data, body) in yaml.items():
        (root / f"{task}.yaml").write_text(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                           f"    test: {root / data}.jsonl\ntest_split: test\n{body}")


def export_folder(model, out: Path) -> None:
    """What `dtrain export` writes, from a model in memory."""
    out.mkdir(parents=True)
    save_file(to_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model), indent=2))
    write_hf_tokenizer(out, hf_tokenizer_files(model.config.block_size))


class Clock:
    """Times the model calls the harness makes and counts their requests."""

    def __init__(self, lm):
        self.seconds = {kind: 0.0 for kind in TASKS.values()}
        self.requests = {kind: 0 for kind in TASKS.values()}
        for kind in self.seconds:
            setattr(lm, kind, self._timed(kind, getattr(lm, kind)))

    def _timed(self, kind, fn):
        def call(requests, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(requests, *args, **kwargs)
            self.seconds[kind] += time.perf_counter() - t0
            self.requests[kind] += len(requests)
            return out

        return call


def score(lm, manager, repeats: int) -> tuple[dict, dict[str, float], dict[str, int]]:
    """(results, the best requests/s of `repeats` passes per request kind, requests per pass)."""
    clock = Clock(lm)
    best = {kind: 0.0 for kind in TASKS.values()}
    for _ in range(repeats):
        clock.seconds = {kind: 0.0 for kind in TASKS.values()}
        clock.requests = {kind: 0 for kind in TASKS.values()}
        results = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=manager, bootstrap_iters=0,
                                          log_samples=False)
        for kind in best:
            best[kind] = max(best[kind], clock.requests[kind] / clock.seconds[kind])
    return results["results"], best, clock.requests


def agree(a: dict, b: dict) -> bool:
    for task, metrics in a.items():
        for key, value in metrics.items():
            other = b[task][key]
            if isinstance(value, float) and isinstance(other, float):
                if not math.isclose(value, other, rel_tol=1e-6):
                    return False
            elif value != other:
                return False
    return True


def save_run(model, cfg, run: Path) -> Path:
    """A run directory `dtrain eval` reads: the resolved config and the weights as a state_dict file."""
    write_config_record(run, to_dict(cfg))
    torch.save(model.state_dict(), run / "weights.pt")
    return run / "weights.pt"


def eval_rate(run: Path, weights: Path, task: str, tasks_dir: Path, world: int, threads: int,
              args) -> tuple[float, dict]:
    """(requests/s over the model's calls, the task's metrics) of `dtrain eval RUN --tasks task world=N`."""
    cmd = [sys.executable, "-m", "trainer", "eval", str(run), "--tasks", task, "--include-path", str(tasks_dir),
           "--batch-size", str(args.batch_size), "--bootstrap-iters", "0", "--device", args.device,
           f"ckpt={weights}", f"world={world}", f"launch.threads_per_worker={threads}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    record = json.loads((run / "eval_harness.json").read_text())
    kind = TASKS[task]
    return record["requests"][kind] / record["model_s"][kind], record["results"][task]


def world_rows(model, cfg, name: str, tmp: Path, args) -> list[tuple]:
    """(model, request kind, world, threads per worker, requests/s, vs world 1 on all threads,
    vs world 1 on one worker's threads, metrics equal world 1's) rows."""
    weights = save_run(model, cfg, tmp / f"run_{name}")
    cores = args.threads
    setups = [(1, cores)] + [(w, max(1, cores // w)) for w in args.worlds if w > 1]
    setups += [(1, t) for t in sorted({t for _, t in setups[1:]} - {cores})]  # a worker's share of the cores
    rows = []
    for task, kind in TASKS.items():
        rates, metrics = {}, {}
        for setup in setups:
            for _ in range(args.repeats):
                rate, metrics[setup] = eval_rate(weights.parent, weights, task, tmp / "tasks", *setup, args)
                rates[setup] = max(rates.get(setup, 0.0), rate)
        for world, threads in setups:
            rate = rates[(world, threads)]
            rows.append((name, kind, world, threads, rate, rate / rates[(1, cores)], rate / rates[(1, threads)],
                         metrics[(world, threads)] == metrics[(1, cores)]))
    return rows


def end_to_end(model, cfg, name: str, tmp: Path, args) -> tuple[float, float, int, int, dict]:
    """(best wall s of `dtrain eval RUN --tasks bench_gen_e2e`, best wall s of `lm_eval --model hf`
    on the export, requests whose outputs are equal, requests, dtrain's last record): whole
    commands, as a user runs them, taking turns --repeats times; each logs its samples."""
    weights = save_run(model, cfg, tmp / f"e2e_{name}")
    tasks, out = tmp / "tasks", tmp / f"hf_out_{name}"
    common = ["--tasks", E2E_TASK, "--device", args.device]
    ours = [sys.executable, "-m", "trainer", "eval", str(weights.parent), *common, "--include-path", str(tasks),
            "--batch-size", str(args.batch_size), "--log-samples", f"ckpt={weights}",
            f"launch.threads_per_worker={args.threads}"]
    theirs = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args",
              f"pretrained={tmp / name},dtype=float32", *common, "--include_path", str(tasks),
              "--batch_size", str(args.batch_size), "--log_samples", "--output_path", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # hf's torch: as many threads as dtrain's
    best = {"dtrain": math.inf, "hf": math.inf}
    for _ in range(args.repeats):
        for who, cmd in (("dtrain", ours), ("hf", theirs)):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
            best[who] = min(best[who], time.perf_counter() - t0)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    mine = responses(weights.parent / f"eval_samples_{E2E_TASK}.jsonl")
    hf = responses(max(out.glob(f"**/samples_{E2E_TASK}_*.jsonl"), key=lambda p: p.stat().st_mtime))
    equal = sum(mine.get(doc) == answer for doc, answer in hf.items())
    return best["dtrain"], best["hf"], equal, len(hf), json.loads((weights.parent / "eval_harness.json").read_text())


def responses(path: Path) -> dict[int, tuple]:
    """doc_id -> (resps, filtered_resps) of a harness samples file."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["doc_id"]: (r["resps"], r["filtered_resps"]) for r in lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cpu_small", "gpt2_124m"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--examples", type=int, default=48, help="multiple-choice examples")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per model; the best one counts")
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2],
                        help="worker counts for `dtrain eval ... world=N`, each with --threads / N threads "
                             "(none: skip that table)")
    parser.add_argument("--end-to-end", type=int, default=48, metavar="N",
                        help="generation requests of the end-to-end table (whole commands: `dtrain eval --tasks` "
                             "against `lm_eval --model hf` on the export); 0: skip it")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    table = Table(title=f"lm-evaluation-harness: requests/s, batch {args.batch_size}, {args.device}, "
                        f"{args.threads} thread(s), lm-eval {lm_eval.__version__}")
    for col in ("model", "requests", "n", "dtrain req/s", "hf req/s", "dtrain / hf", "metrics equal"):
        table.add_column(col, justify="left" if col in ("model", "requests") else "right")
    scaling = Table(title=f"dtrain eval --tasks T world=N: requests/s over the model's calls, batch {args.batch_size}, "
                          f"{args.device}, {args.threads} threads in all")
    for col in ("model", "requests", "world", "threads each", "req/s", f"vs world 1 ({args.threads} threads)",
                "vs world 1 (same threads)", "metrics = world 1"):
        scaling.add_column(col, justify="left" if col in ("model", "requests") else "right")
    whole = Table(title=f"end to end: `dtrain eval RUN --tasks T` against `lm_eval --model hf` on the export, "
                        f"generate_until, wall s (best of {args.repeats}), batch {args.batch_size}, {args.device}")
    for col in ("model", "requests", "dtrain eval s", "lm_eval hf s", "hf / dtrain",
                "dtrain: load / harness / model s", "outputs equal"):
        whole.add_column(col, justify="left" if col == "model" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "tasks").mkdir()
        write_tasks(tmp / "tasks", args.examples, args.end_to_end)
        manager = task_manager(str(tmp / "tasks"))
        for name in args.models:
            torch.manual_seed(0)
            cfg = compose([f"model={name}"])
            model = build_model(cfg.model).eval()
            export_folder(model, tmp / name)
            ours = DtrainLM(model, batch_size=args.batch_size, device=args.device)
            hf = HFLM(pretrained=str(tmp / name), device=args.device, dtype="float32", batch_size=args.batch_size)
            score(ours, manager, 1), score(hf, manager, 1)  # warm-up: dataset cache, first-call allocations
            r_ours, rate_ours, n = score(ours, manager, args.repeats)
            r_hf, rate_hf, _ = score(hf, manager, args.repeats)
            equal = "yes" if agree(r_ours, r_hf) else "NO"
            for kind in TASKS.values():
                table.add_row(name, kind, str(n[kind]), f"{rate_ours[kind]:,.1f}", f"{rate_hf[kind]:,.1f}",
                              f"{rate_ours[kind] / rate_hf[kind]:.2f}x", equal)
            if args.end_to_end:
                ours_s, hf_s, equal, n_req, record = end_to_end(model, cfg, name, tmp, args)
                split = f"{record['load_s']:.1f} / {record['wall_s']:.1f} / {sum(record['model_s'].values()):.1f}"
                whole.add_row(name, str(n_req), f"{ours_s:.1f}", f"{hf_s:.1f}", f"{hf_s / ours_s:.2f}x", split,
                              f"{equal} of {n_req}")
            for row in world_rows(model, cfg, name, tmp, args) if args.worlds else []:
                model_name, kind, world, threads, rate, speedup, per_worker, same = row
                scaling.add_row(model_name, kind, str(world), str(threads), f"{rate:,.1f}", f"{speedup:.2f}x",
                                f"{per_worker:.2f}x", "yes" if same else "NO")
    console = Console(width=max(Console().width, 110))
    console.print(table)
    if args.end_to_end:
        console.print(whole)
    if args.worlds:
        console.print(scaling)


if __name__ == "__main__":
    main()
