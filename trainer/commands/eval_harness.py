"""The `--tasks` half of `dtrain eval`: a checkpoint scored by EleutherAI's lm-evaluation-harness.

    dtrain eval RUN_DIR --tasks hellaswag,arc_easy [--include-path DIR] [--limit N] [--num-fewshot K]
                        [--batch-size B] [--step N | ckpt=PATH] [--device cpu|cuda|auto] [--log-samples]
                        [--out DIR] [--tokenizer DIR] [world=N] [launch.threads_per_worker=T]

The weights come straight from the DCP checkpoint (verified, and refused when corrupt or non-finite,
as everywhere) into dtrain's own GPT, which trainer/evals/harness.py presents to the harness as a
model: no Hugging Face conversion, no model download. Its tokenizer is the run's own, the copy the
checkpoint holds (trainer/checkpoint/tokenizer_copy.py; --tokenizer DIR for one saved without).
Task data is the harness's business (it downloads what a task names); `--include-path` adds a
folder of task YAMLs. The harness's results go to <RUN_DIR>/eval_harness.json (`results`, plus
step, checkpoint and timing); `dtrain report` shows them. --log-samples also writes each request's
record as the harness logs it (doc_id, resps, filtered_resps, ...) to
<RUN_DIR>/eval_samples_<task>.jsonl. `--out DIR` puts these files (and the logs of world > 1) into
DIR instead, e.g. for a run on a read-only mount.

world=N splits the requests over N workers started as training starts them (loopback rendezvous):
each scores its share of the batches, every worker gets all results, rank 0 writes them; a batch is
the same on any world size, so the metrics are world=1's. On CPU each worker takes cores / N
threads unless launch.threads_per_worker says otherwise (as in training).
"""

from __future__ import annotations

import importlib.util
import json
import time
from argparse import Namespace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer.checkpoint.layout import enclosing_checkpoint
from trainer.config.schema import LaunchConfig, from_dict, to_dict
from trainer.errors import ConfigError, UserError
from trainer.evals.dealing import Dealer
from trainer.evals.task_data import not_cached, uncached_data
from trainer.fetch.hub import hub_unreachable
from trainer.io import check_writable_dir, not_a_folder, write_atomic, write_errors_as_user_errors
from trainer.launch.workers import run_workers
from trainer.model.gpt import build_model
from trainer.observe.results import HARNESS_FILE, harness_table, table_console
from trainer.preflight.rundir import read_config_record
from trainer.process.runtime import init_runtime
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.from_checkpoint import (
    checkpoint_at_step,
    eval_weights_path,
    load_weights,
    model_from_run,
    tokenizer_for_weights,
    weights_step,
)

INSTALL = "pip install 'dtrain[harness]'"
DEFAULT_BATCH_SIZE = 8
DEFAULT_BOOTSTRAP_ITERS = 100000  # the harness's own default


def harness_eval(args: Namespace, run_dir: Path, overrides: list[str]) -> dict:
    """Score the run's checkpoint on args.tasks; every check comes before the weights are read."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks names no task; e.g. --tasks hellaswag,arc_easy")
    ckpt, counts = None, {"world": 1, "launch.threads_per_worker": None}
    for arg in overrides:
        key, value = arg.split("=", 1)
        if key == "ckpt":
            ckpt = value
        elif key == "eval.limit":  # the built-in HellaSwag's key for --limit, taken here too
            if args.limit is not None:
                raise ConfigError("give --limit N or eval.limit=N, not both")
            try:
                args.limit = float(value)
            except ValueError:
                raise ConfigError(f"eval.limit={value}: a number of examples (or a fraction of them below 1)") from None
        elif key in counts:
            if not value.isdigit() or int(value) < 1:
                what = "workers" if key == "world" else "CPU threads per worker"
                raise ConfigError(f"{key}={value}: a number of {what}, 1 or more")
            counts[key] = int(value)
        else:
            raise ConfigError(f"{arg!r} does not apply to --tasks; it takes ckpt=PATH, eval.limit=N, world=N and "
                              "launch.threads_per_worker=T besides its flags")
    if ckpt is not None and args.step is not None:
        raise ConfigError("give --step N or ckpt=PATH, not both")
    limit = args.limit
    if limit is not None and limit >= 1:
        if not limit.is_integer():
            raise ConfigError(f"--limit {limit}: a whole number of examples, or a fraction of them below 1")
        limit = int(limit)
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    bootstrap_iters = DEFAULT_BOOTSTRAP_ITERS if args.bootstrap_iters is None else args.bootstrap_iters
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"--tasks runs EleutherAI's lm-evaluation-harness, which is not installed: {INSTALL}")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ConfigError(f"--include-path {args.include_path} {not_a_folder(args.include_path)}; "
                          "pass a folder of task YAML files")
    device = _device(args.device or "auto")
    out, fix = check_results_folder(args.out, run_dir)
    if args.step is not None:
        weights = checkpoint_at_step(run_dir, args.step)
    else:
        weights = Path(eval_weights_path(run_dir, ckpt))
    # the checkpoint's own tokenizer (its copy, checked against its record), read by every worker
    recorded = None if weights.is_dir() else from_dict(read_config_record(run_dir)).tokenizer
    tokenizer = tokenizer_for_weights(run_dir, str(weights), recorded, args.tokenizer)

    # The harness (seconds to import) and its task index only now, after every check that needs neither;
    # the task names are checked before the weights are read.
    offline = hub_unreachable()  # before the harness imports the Hub's clients, which read it
    if offline and args.include_path is None:  # data surely not cached: one line now, not after importing the harness
        missing = uncached_data(tasks)
        if missing:
            named = ", ".join(f"{task}'s ({dataset})" for task, dataset in missing)
            raise UserError(not_cached(offline, f"{named} data"))
    from trainer.evals import harness, task_index  # the optional extra dtrain[harness]: only for --tasks

    manager = task_index.task_manager(args.include_path)
    harness.check_tasks(tasks, manager)
    if offline:  # the tasks' data from the cache, or one line now (not after the workers' retries)
        harness.load_tasks(tasks, manager, offline)
    job = {"tasks": tasks, "run_dir": str(run_dir), "out": str(out), "fix": fix, "weights": str(weights),
           "device": str(device),
           "include_path": args.include_path, "limit": limit, "num_fewshot": args.num_fewshot,
           "batch_size": batch_size, "bootstrap_iters": bootstrap_iters, "log_samples": bool(args.log_samples),
           "threads": counts["launch.threads_per_worker"],
           "tokenizer": {"name": tokenizer.name, "path": tokenizer.path}}
    launch = to_dict(OmegaConf.structured(LaunchConfig))
    return run_workers(harness_worker, (job, manager), launch, counts["world"], out / "logs")


def check_results_folder(out: Path | None, run_dir: Path) -> tuple[Path, str]:
    """(the folder an evaluation's results go to: --out, else the run directory; the advice for
    choosing another), refused before the weights are read when it cannot take them: a file, a
    read-only or full disk, a checkpoint folder (only a save writes there)."""
    if out is None:
        out, what = run_dir, f"the run directory {run_dir} (where the results go without --out)"
        fix = "write them elsewhere with --out DIR"
    else:
        out, what, fix = out.absolute(), f"--out {out}", "choose another --out DIR"
    checkpoint = enclosing_checkpoint(out)
    if checkpoint is not None:
        raise UserError(f"{what} is in the checkpoint folder {checkpoint}, where only a save writes; {fix}")
    check_writable_dir(out, what, fix)
    return out, fix


def harness_worker(job: dict, manager) -> dict:
    """One worker of `dtrain eval --tasks` (module level: torchrun's engine spawns it): the whole
    harness runs on every rank, the model's requests split over them; rank 0 writes and prints.
    `manager` is the driver's task index (a TaskManager), built once per command: one worker runs
    in the driver and uses it as it is; spawned workers get it pickled, which takes about a tenth
    of the time building it again would (its ~14k built-in YAML files parsed)."""
    launch = LaunchConfig()
    rt = init_runtime(job["device"], False, launch.timeout_s, job["threads"])
    try:
        return _score(job, manager, rt)
    finally:
        rt.shutdown()


def _score(job: dict, manager, rt) -> dict:
    from trainer.evals import harness  # the optional extra dtrain[harness]: only for --tasks

    run_dir, out, weights = Path(job["run_dir"]), Path(job["out"]), Path(job["weights"])
    t0 = time.perf_counter()
    if weights.is_dir():
        model, cfg = model_from_run(weights)
    else:  # a state_dict file: the run's recorded model
        cfg = from_dict(read_config_record(run_dir))
        model = build_model(cfg.model)
        load_weights(model, str(weights))
    load_s = time.perf_counter() - t0
    lm = harness.DtrainLM(model, batch_size=job["batch_size"], device=rt.device, dealer=Dealer(rt),
                          tokenizer=load_tokenizer(job["tokenizer"]))  # the run's, as training encoded
    results, wall = harness.evaluate(lm, job["tasks"], manager, limit=job["limit"], num_fewshot=job["num_fewshot"],
                                     bootstrap_iters=job["bootstrap_iters"], log_samples=job["log_samples"])
    if not rt.is_main:  # the harness builds its results on (local) rank 0 only; the others return None
        return {}
    n_requests = sum(lm.requests.values())
    record = {
        "results": results["results"],
        "groups": results.get("groups") or {},
        "versions": results.get("versions") or {},
        "n-samples": results.get("n-samples") or {},
        "higher_is_better": results.get("higher_is_better") or {},
        "tasks": job["tasks"],
        "run_dir": str(run_dir),
        "checkpoint": str(weights),
        "step": weights_step(str(weights)),
        "model": cfg.model.name,
        "limit": job["limit"],
        "num_fewshot": job["num_fewshot"],
        "batch_size": job["batch_size"],
        "device": str(rt.device),
        "world": rt.world,
        "threads_per_worker": torch.get_num_threads() if rt.device.type == "cpu" else None,
        "include_path": str(Path(job["include_path"]).absolute()) if job["include_path"] else None,
        "lm_eval_version": harness.HARNESS_VERSION,
        "requests": dict(lm.requests),
        "requests_per_s": round(n_requests / wall, 3) if wall > 0 else None,
        "model_s": {kind: round(s, 3) for kind, s in lm.seconds.items()},  # the rest of wall_s is the harness's
        "load_s": round(load_s, 3),
        "wall_s": round(wall, 3),
    }
    path = out / HARNESS_FILE
    with write_errors_as_user_errors(out, job["fix"]):
        out.mkdir(parents=True, exist_ok=True)
        if job["log_samples"]:
            record["samples"] = {task: str(p) for task, p in harness.write_samples(results, out).items()}
        write_atomic(path, json.dumps(record, indent=2, default=str) + "\n")
    console = table_console()
    console.print(harness_table(record, f"lm-evaluation-harness: {', '.join(job['tasks'])}"))
    console.print(f"{n_requests:,} requests in {wall:.1f} s ({record['requests_per_s']}/s on {rt.world} x "
                  f"{rt.device}); written to {path}", highlight=False, soft_wrap=True)
    return record


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    return device
