"""Shared fixtures: one small prepared dataset per test session, the runs several modules check
(trained once per session), and the lm-evaluation-harness setup. Plain helpers live in helpers/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import checkpointed_tiny_run
from helpers.dtrain import SMALL_VOCAB, corpus_text, prepare_corpus, run_dtrain, tiny_args, train_losses
from helpers.evals import BATCH, evaluate, make_examples, write_jsonl, write_tasks
from helpers.once import folder_name, made_once, session_folder
from helpers.runs import ONE_PROCESS, REFERENCE_BATCH, REFERENCE_STEPS, reference_run

from trainer.commands.export import cmd_export
from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.fit.run import Run
from trainer.preflight.rundir import write_config_record
from trainer.process.runtime import Runtime


class ModuleFolders:
    """`tmp_path_factory.mktemp` for one module's shared runs: folders under one root per module."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()  # two fixtures of a module asking for one name is a test bug: fail loudly
        return path


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """Folders for a module's shared runs, removed when its last test is done unless one of its tests
    failed (kept as evidence). A tiny run with the GPT-2 vocabulary saves about 77 MB a checkpoint:
    a suite that kept every module's runs, and every passed test's folder (pyproject's
    tmp_path_retention_policy removes those), to the end wrote 24 GB and filled a CI machine's disk."""
    root = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    failed_before = request.session.testsfailed
    yield ModuleFolders(root)
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A prepared `text` dataset named `corpus` (about 550k tokens) with its own byte-level BPE of
    SMALL_VOCAB ids in `tokenizer/` (`dtrain tokenizer train`), which tiny_args passes to every run on
    it: GPT-2's 50,257-row embedding and head were most of a tiny model's step time and of each
    checkpoint's 77 MB. Shared by the whole session, every worker's tests included (the runs made once
    read it by its path)."""
    return made_once(session_folder(tmp_path_factory) / "data", lambda root: prepare_corpus(root, SMALL_VOCAB))


@pytest.fixture(scope="session")
def gpt2_data_dir(tmp_path_factory) -> Path:
    """The same corpus prepared with GPT-2's tokenizer, for what only GPT-2's vocabulary shows: a
    Hugging Face GPT-2 export transformers loads, HellaSwag and the harness on GPT-2 tokens."""
    return made_once(session_folder(tmp_path_factory) / "data_gpt2", lambda root: prepare_corpus(root, None))


@pytest.fixture(scope="session")
def shared_run(data_dir, tmp_path_factory):
    """args -> (run dir, stdout) of the uninterrupted `tiny_args(data_dir, <dir>, *args)` run,
    trained once per session by whichever worker asks first (helpers.once): the modules that check
    the same run (test_parity's and test_compat's modes, test_muon's and test_compat's Muon runs, the
    references) share it. Read-only, for every worker reads it at once: a test that continues or
    damages a run, or runs a command that writes into its folder (`dtrain eval`), makes its own."""
    root = session_folder(tmp_path_factory)

    def train(run_dir: Path, args: tuple[str, ...]) -> None:
        proc = run_dtrain(tiny_args(data_dir, run_dir, *args), check=True)
        # beside the run dir, which holds the run's own files only
        run_dir.with_suffix(".stdout").write_text(proc.stdout)
        run_dir.with_suffix(".stderr").write_text(proc.stderr)

    def get(*args: str) -> tuple[Path, str]:
        run_dir = made_once(root / folder_name(*args), lambda folder: train(folder, args))
        return run_dir, run_dir.with_suffix(".stdout").read_text()

    return get


@pytest.fixture(scope="session")
def adamw_reference(shared_run) -> dict[int, float]:
    """step -> loss of the one-process AdamW reference (micro batch 2, accumulation 4)."""
    run_dir, _ = shared_run(*REFERENCE_BATCH, *ONE_PROCESS)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


@pytest.fixture(scope="session")
def references(data_dir, tmp_path_factory):
    """mode -> the uninterrupted checkpointed run of helpers.runs' CKPT_ARGS in that mode (made once
    per session by whichever worker asks first: the fault tests resume, damage copies of, or compare
    with it; read-only, as shared_run's)."""
    return lambda mode: reference_run(mode, data_dir, session_folder(tmp_path_factory))


@pytest.fixture(scope="module")
def trained(module_tmp):
    """A tiny GPT (vocabulary padded to 50304) trained three AdamW steps in this process and
    checkpointed with the real Checkpointer; returns (run dir, the live trained model)."""
    run_dir = module_tmp.mktemp("export") / "run"
    _, model = checkpointed_tiny_run(run_dir, ["model.pad_vocab_multiple=64"], steps=3, tokens_per_step=32)
    return run_dir, model.eval()


@pytest.fixture(scope="module")
def hf_folder(trained, module_tmp) -> Path:
    """`trained`'s run exported as a Hugging Face folder (test_export, test_export_pipeline)."""
    out = module_tmp.mktemp("hf") / "export"
    cmd_export([str(trained[0]), "--out", str(out)])
    return out


# --- lm-evaluation-harness: one of each per session for test_harness and test_harness_workers ------
@pytest.fixture(scope="session")
def harness_run(gpt2_data_dir, tmp_path_factory) -> Path:
    """A tiny GPT-2-vocabulary run: the harness's `hf` model reads its export with GPT-2's tokenizer."""
    run = tmp_path_factory.mktemp("harness") / "run"
    run_dtrain(tiny_args(gpt2_data_dir, run, "train.max_steps=10"), check=True)
    return run


@pytest.fixture(scope="session")
def harness_tasks(tmp_path_factory) -> Path:
    """Four local tasks over jsonl files: multiple choice (acc, acc_norm), rolling loglikelihood
    (perplexities, documents longer than the 128-token block), greedy generation and generation
    that samples (temperature, top_k, top_p)."""
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="session")
def harness_hf_model(harness_run, tmp_path_factory):
    """The harness's own `hf` model on `dtrain export`'s folder (weights, config, tokenizer files)."""
    from lm_eval.models.huggingface import HFLM  # the optional harness extra: only where it is used

    out = tmp_path_factory.mktemp("export") / "hf"
    run_dtrain(["export", str(harness_run), "--out", str(out)], check=True)
    return HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=BATCH)


@pytest.fixture(scope="session")
def harness_world1(harness_run, harness_tasks) -> tuple[dict, dict[str, list[dict]]]:
    """`dtrain eval --tasks` at world 1: its record and per-request samples (test_harness compares
    them with the `hf` model, test_harness_workers with world 2)."""
    return evaluate(harness_run, harness_tasks)


# --- HellaSwag: one trained run per session for test_hellaswag, test_hellaswag_workers, test_cli_errors
@pytest.fixture(scope="session")
def hellaswag_run(gpt2_data_dir, tmp_path_factory):
    """A tiny GPT trained for 24 steps (4 x 64 tokens each) on the session corpus through the
    project's own Run, saved as a run dir (resolved config + state_dict), plus HellaSwag-format files
    for it. (10 steps already take the easy set from chance to 43/43.) The tests that run `dtrain
    eval` on it write only its eval_hellaswag.json."""
    root = tmp_path_factory.mktemp("hellaswag")
    run_dir = root / "run"
    overrides = [a for a in tiny_args(gpt2_data_dir, run_dir) if "=" in a and not a.startswith("hydra.")]
    cfg = compose(overrides + ["train.max_steps=24", "optim.lr=3e-3", "data.val_fraction=0.1"])
    run = Run(cfg, Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"),
                           distributed=False), run_dir)
    for step in range(cfg.train.max_steps):
        run.train_step(step)
    write_config_record(run_dir, to_dict(cfg))
    torch.save(run.model.state_dict(), run_dir / "model.pt")
    easy, hard = make_examples(corpus_text(), n_easy=43, n_hard=48)
    files = {"easy": write_jsonl(root / "easy.jsonl", easy), "hard": write_jsonl(root / "hard.jsonl", hard),
             "all": write_jsonl(root / "all.jsonl", easy + hard)}
    model = run.model.eval()
    return {"run_dir": run_dir, "cfg": cfg, "model": model, "files": files}
