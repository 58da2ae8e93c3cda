"""`dtrain eval RUN_DIR`: HellaSwag accuracy of a run's newest checkpoint, on 1 or N workers.

    dtrain eval RUN_DIR [--out DIR] [world=N] [parallel=MODE] [ckpt=PATH] [eval.limit=N] [--tokenizer DIR]
                        [eval.hellaswag.path=FILE] [eval.hellaswag.batch_examples=B] [key=value ...]

The run's recorded config gives the model, the data dir (where the HellaSwag download is cached)
and eval.hellaswag.*; eval.limit starts at null (every example); the overrides are dotted keys of
the same schema. `world` and `parallel` default to 1 and `none` (a full replica per worker, each
scoring its share); parallel=fsdp shards the weights over the workers. `ckpt=` picks a checkpoint
(a step_* folder or a run dir; default: this run's newest) or a plain state_dict file (torch.save
of GPT.state_dict()). The examples are encoded by the run's own tokenizer, the copy its checkpoint
holds (trainer/checkpoint/tokenizer_copy.py; `--tokenizer DIR` names the folder for a checkpoint
saved before checkpoints kept one). With world > 1 the workers start through torchrun's engine,
like training; under plain torchrun (`torchrun --standalone --nproc-per-node=N -m trainer eval RUN_DIR`) every
rank runs this command and they join one group. Rank 0 shows a progress bar (on a terminal;
train.progress=false hides it), prints the result and writes <RUN_DIR>/eval_hellaswag.json (with
--out DIR: DIR/eval_hellaswag.json, e.g. for a run on a read-only mount).

With --tasks, EleutherAI's lm-evaluation-harness scores the checkpoint instead, on 1 or N workers
(the optional extra dtrain[harness]; trainer/commands/eval_harness.py):

    dtrain eval RUN_DIR --tasks hellaswag,arc_easy [--include-path DIR] [--limit N] [--num-fewshot K]
                        [--batch-size B] [--step N | ckpt=PATH] [--device cpu|cuda|auto] [--log-samples]
                        [--tokenizer DIR] [world=N]

and writes <RUN_DIR>/eval_harness.json (with --log-samples also <RUN_DIR>/eval_samples_<task>.jsonl).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from trainer.checkpoint.tokenizer_copy import TOKENIZER_HELP
from trainer.commands.args import ArgParser, folder_to_write, non_negative_int, positive
from trainer.commands.eval_harness import check_results_folder, harness_eval
from trainer.config.batch import requested_world
from trainer.config.schema import PARALLEL_MODES, LaunchConfig, from_dict, to_dict
from trainer.config.validation import check_ranges
from trainer.errors import ConfigError
from trainer.evals.hellaswag import HellaSwagEval
from trainer.evals.hellaswag_file import hellaswag_file
from trainer.io import not_a_folder, write_atomic, write_errors_as_user_errors
from trainer.launch.workers import run_workers
from trainer.model.gpt import build_model
from trainer.observe.metrics import print_whole, summary_table
from trainer.observe.results import HARNESS_FILE, HELLASWAG_RESULT_FILE
from trainer.parallel import make_strategy, strategy_class
from trainer.preflight.rundir import read_config_record
from trainer.process.env import under_torchrun
from trainer.process.runtime import init_runtime
from trainer.tokenizers.load import load_tokenizer
from trainer.weights.from_checkpoint import (
    checkpoint_at_step,
    eval_weights_path,
    load_weights,
    tokenizer_for_weights,
    weights_step,
)

RESULT_FILE = HELLASWAG_RESULT_FILE
HARNESS_FLAGS = ("include_path", "num_fewshot", "batch_size", "device", "bootstrap_iters", "log_samples")


def cmd_eval(argv: list[str]) -> dict:
    """Score the run's weights; a worker that crashes raises trainer.errors.WorkerFailed (its
    report, traceback included), a user error in a worker raises UserError."""
    parser = _parser()
    args = parser.parse_args(argv)
    run_dir, overrides = _run_dir_and_overrides(parser, args)
    if args.tasks is not None:
        return harness_eval(args, run_dir, overrides)
    given = [f"--{f.replace('_', '-')}" for f in HARNESS_FLAGS if getattr(args, f) is not None]
    if given:
        parser.error(f"{given[0]} goes with --tasks (lm-evaluation-harness); the built-in HellaSwag takes "
                     "--step N, --limit N and key=value overrides such as eval.limit=N or ckpt=PATH")
    overrides = _shared_flags_as_overrides(args, run_dir, overrides)
    run_dir, cfg, weights = eval_setup(parser, run_dir, overrides, args.tokenizer)
    out, fix = check_results_folder(args.out, run_dir)  # a read-only run directory: one line, before work
    cfg_dict = to_dict(cfg)
    world = requested_world(cfg)
    job = (cfg_dict, str(run_dir), weights, str(out), fix)
    if under_torchrun():
        return eval_worker(*job)
    # Fetch the file once here, so a download problem is one clear line before any worker starts
    # and the workers only read it.
    cfg_dict["eval"]["hellaswag"]["path"] = str(hellaswag_file(cfg.eval.hellaswag, cfg.data.dir))
    return run_workers(eval_worker, job, cfg_dict["launch"], world, out / "logs")


def _shared_flags_as_overrides(args, run_dir: Path, overrides: list[str]) -> list[str]:
    """--step N and --limit N, the flags both scorers take, as the built-in HellaSwag's keys
    (ckpt=<the step's checkpoint>, eval.limit=N); giving a flag and its key both is one line."""
    keys = {a.split("=", 1)[0] for a in overrides}
    if args.step is not None:
        if "ckpt" in keys:
            raise ConfigError("give --step N or ckpt=PATH, not both")
        overrides = [*overrides, f"ckpt={checkpoint_at_step(run_dir, args.step)}"]
    if args.limit is not None:
        if "eval.limit" in keys:
            raise ConfigError("give --limit N or eval.limit=N, not both")
        if args.limit < 1 or not float(args.limit).is_integer():
            raise ConfigError(f"--limit {args.limit}: the built-in HellaSwag takes a whole number of examples")
        overrides = [*overrides, f"eval.limit={int(args.limit)}"]
    return overrides


def _parser() -> ArgParser:
    parser = ArgParser(
        prog="dtrain eval",
        description=__doc__,
        usage="%(prog)s RUN_DIR [--out DIR] [--step N | ckpt=PATH] [--limit N | eval.limit=N] [world=N] "
              "[parallel=MODE] "
              "[eval.hellaswag.path=FILE] [key=value ...] | RUN_DIR --tasks T1,T2 [--include-path DIR] [--limit N]",
    )
    # One positional list: the run dir is the argument without "=", wherever it stands.
    parser.add_argument("arguments", nargs="*", metavar="RUN_DIR | key=value",
                        help="the run whose checkpoint is scored; overrides: world=N, parallel=MODE, ckpt=PATH "
                             "or a dotted key of the run's config")
    harness = parser.add_argument_group("lm-evaluation-harness (pip install 'dtrain[harness]')")
    parser.add_argument("--out", metavar="DIR", type=folder_to_write,
                        help=f"where the results ({RESULT_FILE}, {HARNESS_FILE}) and the logs of world > 1 go "
                             "(default: RUN_DIR)")
    harness.add_argument("--tasks", metavar="T1,T2", help="score with the harness on these tasks, groups or tags")
    harness.add_argument("--include-path", metavar="DIR", help="a folder of extra task YAMLs")
    parser.add_argument("--limit", type=positive(float), metavar="N",
                        help="at most N examples (per task with --tasks; there, below 1: that fraction of them)")
    harness.add_argument("--num-fewshot", type=non_negative_int, metavar="K", help="few-shot examples per prompt")
    harness.add_argument("--batch-size", type=positive(int), metavar="B", help="sequences per forward (default 8)")
    parser.add_argument("--step", type=non_negative_int, metavar="N", help="this checkpoint step (default: newest)")
    parser.add_argument("--tokenizer", metavar="DIR", help=TOKENIZER_HELP)
    harness.add_argument("--device", metavar="DEV", help="cpu, cuda, cuda:N or auto (default)")
    harness.add_argument("--log-samples", action="store_true", default=None,
                         help="also write each request's record to <RUN_DIR>/eval_samples_<task>.jsonl")
    harness.add_argument("--bootstrap-iters", type=non_negative_int, metavar="N",
                         help="bootstrap resamples for the stderr of non-mean metrics (default 100000; 0: none)")
    return parser


def _run_dir_and_overrides(parser: ArgParser, args) -> tuple[Path, list[str]]:
    positional = [a for a in args.arguments if "=" not in a]
    overrides = [a for a in args.arguments if "=" in a]
    if len(positional) != 1:
        parser.error(f"takes one run directory (the argument without '='), got {len(positional)}")
    run_dir = Path(positional[0]).expanduser().absolute()
    if not run_dir.is_dir():
        parser.error(f"run directory {run_dir} {not_a_folder(run_dir)}")
    return run_dir, overrides


def eval_setup(parser: ArgParser, run_dir: Path, overrides: list[str],
               tokenizer_dir: str | None = None) -> tuple[Path, object, str]:
    """The run dir, the eval config (the run's, with eval defaults and the overrides, its tokenizer
    the one the weights were trained with: a checkpoint's copy, or `tokenizer_dir`, --tokenizer DIR)
    and the weights to load (a checkpoint dir or a state_dict file)."""
    record = read_config_record(run_dir)
    # The run's own world, mode and launch settings describe training, not this evaluation.
    record["world"] = None
    record.setdefault("parallel", {})["mode"] = "none"
    record["launch"] = to_dict(OmegaConf.structured(LaunchConfig))
    # Training's eval.limit keeps its periodic evals short; a standalone eval scores every example
    # unless eval.limit= is given again.
    record.setdefault("eval", {})["limit"] = None
    record.setdefault("train", {})["progress"] = True  # on a terminal; train.progress=false hides it
    ckpt = None
    dotlist = []
    for arg in overrides:
        key, value = arg.split("=", 1)
        if key == "ckpt":
            ckpt = value
        elif key == "parallel":
            dotlist.append(f"parallel.mode={value}")
        else:
            dotlist.append(arg)
    try:
        cfg = from_dict(record)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
        world = requested_world(cfg)
    except OmegaConfBaseException as err:
        message = " ".join(str(err).split()[:40])
        raise ConfigError(f"bad override: {message}; usage: {parser.usage_line()}") from None
    # eval.limit=-1 or eval.hellaswag.batch_examples=0: one line before any file is looked for (the
    # rest waits for the checkpoint's tokenizer, which model.vocab_size is checked against)
    check_ranges(cfg, ("eval",))
    mode = cfg.parallel.mode
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"parallel={mode!r} is unknown; choose one of {', '.join(PARALLEL_MODES)}")
    if strategy_class(mode).one_process_many_devices and world > 1:
        raise ConfigError(f"parallel={mode} runs in one process; use parallel=none or ddp with world={world}")
    if world < 1 or world % cfg.launch.nnodes:
        raise ConfigError(f"world={world} must be a positive multiple of launch.nnodes={cfg.launch.nnodes}")
    weights = eval_weights_path(run_dir, ckpt)
    # the checkpoint's own tokenizer (its copy, checked against its record), read by every worker
    tokenizer = tokenizer_for_weights(run_dir, weights, cfg.tokenizer, tokenizer_dir)
    for section in (cfg.tokenizer, cfg.data.tokenizer):
        section.name, section.path, section.checkpoint = tokenizer.name, tokenizer.path, None
    check_ranges(cfg)
    return run_dir, cfg, weights


def eval_worker(cfg_dict: dict, run_dir: str, weights: str, out: str, fix: str) -> dict:
    """One worker of `dtrain eval` (module level: torchrun's engine spawns it); rank 0's dict is the
    result, written into `out` (`fix`: how to choose another folder, for a write that fails)."""
    cfg = from_dict(cfg_dict)
    rt = init_runtime(
        cfg.train.device,
        strategy_class(cfg.parallel.mode).needs_process_group,
        cfg.launch.timeout_s,
        cfg.launch.threads_per_worker,
    )
    try:
        # plain torchrun: rank 0's weights
        return _evaluate(cfg, rt, Path(run_dir), rt.broadcast_object(weights), Path(out), fix)
    finally:
        rt.shutdown()


def _evaluate(cfg, rt, run_dir: Path, weights: str, out: Path, fix: str) -> dict:
    """Score the weights on this rank's share; rank 0 writes and prints the result.

    The model lives only in this frame and is dropped before the caller tears the process group
    down: a DDP model freed after destroy_process_group can deadlock in gloo's destructor (its
    worker thread waits for the GIL that the freeing thread holds; seen at world 4).
    """
    model = strategy = None
    try:
        torch.manual_seed(cfg.train.seed)
        strategy = make_strategy(cfg.parallel, cfg.train, rt, training=False)
        model = build_model(cfg.model)
        load_weights(model, weights)
        model = strategy.wrap(model)
        t_load = time.perf_counter()
        hellaswag = HellaSwagEval.from_config(cfg, rt, load_tokenizer(cfg.tokenizer))  # the checkpoint's (cmd_eval)
        load_s = time.perf_counter() - t_load
        progress = _progress_bar(rt.is_main and cfg.train.progress, hellaswag)
        t0 = time.perf_counter()
        try:
            result = hellaswag.evaluate(strategy.inference_model(model), rt, strategy.autocast,
                                        progress=progress.advance if progress else None)
        finally:
            if progress:
                progress.stop()
        wall = time.perf_counter() - t0
    finally:
        model = strategy = None  # also when an exception's traceback keeps this frame alive
    record = {
        **result.metrics(),
        "hellaswag_correct": result.correct,
        "hellaswag_correct_norm": result.correct_norm,
        "hellaswag_correct_per_token": result.correct_per_token,
        "run_dir": str(run_dir),
        "weights": str(weights),
        "step": weights_step(weights),
        "file": cfg.eval.hellaswag.path or cfg.eval.hellaswag.url,
        "limit": cfg.eval.limit,
        "model": cfg.model.name,
        "world": rt.world,
        "parallel": cfg.parallel.mode,
        "batch_examples": cfg.eval.hellaswag.batch_examples,
        "device": str(rt.device),
        "wall_s": round(wall, 3),
        "load_s": round(load_s, 3),
        "examples_per_s": round(result.n / wall, 3) if wall > 0 else None,
    }
    if rt.is_main:
        with write_errors_as_user_errors(out, fix):
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / RESULT_FILE, json.dumps(record, indent=2) + "\n")
        _print_result(record, out / RESULT_FILE)
    return record


class _Bar:
    def __init__(self, total: int, description: str):
        self.progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), transient=True)
        self.task = self.progress.add_task("hellaswag", total=total)
        self.progress.start()

    def advance(self, k: int) -> None:
        self.progress.advance(self.task, k)

    def stop(self) -> None:
        self.progress.stop()


def _progress_bar(enabled: bool, hellaswag) -> _Bar | None:
    if not enabled or not sys.stdout.isatty():
        return None
    shard = "" if hellaswag.world == 1 else f" (rank 0's share of {hellaswag.n_total:,})"
    return _Bar(hellaswag.n_local, f"[bold]hellaswag[/]{shard}")


def _print_result(record: dict, path: Path) -> None:
    n = record["hellaswag_n"]
    rows = {
        "acc_norm (per character, the harness's)": f"{record['hellaswag_acc_norm']:.4f} "
                                                   f"({record['hellaswag_correct_norm']:,}/{n:,})",
        "acc_per_token (build-nanogpt's acc_norm)": f"{record['hellaswag_acc_per_token']:.4f} "
                                                    f"({record['hellaswag_correct_per_token']:,}/{n:,})",
        "acc": f"{record['hellaswag_acc']:.4f} ({record['hellaswag_correct']:,}/{n:,})",
        "examples": f"{n:,} ({record['examples_per_s']:.1f}/s on {record['world']} worker(s), "
                    f"parallel={record['parallel']})",
        "weights": record["weights"],
        "written to": str(path),
    }
    print_whole(Console(), summary_table("hellaswag", rows))
