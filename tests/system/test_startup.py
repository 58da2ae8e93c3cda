"""A one-process run starts without what it does not use (issue 34 item 6; figures in docs/performance.md).

torch.distributed.checkpoint (DTensor and sympy under it, about 0.7 s) is imported at a run's first
save or restore, not at its start; a run imports its own parallel mode's module only; the memory
plan's shapes-only model does not import torch._dynamo. Offline, `dtrain eval --tasks T` for a
built-in task whose data is in no cache says so in one line before lm-evaluation-harness is imported.

Observed for real: a sitecustomize (loaded by every Python process the test starts) records the
stack that first imports a watched module, through an import hook on sys.meta_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import ONE_CPU_PROCESS
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args

from trainer.checkpoint.finite import module_state_bytes, state_bytes
from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.evals import task_data
from trainer.model.gpt import build_model
from trainer.parallel import STRATEGIES, make_strategy, strategy_class
from trainer.preflight.rundir import write_config_record

DCP = "torch.distributed.checkpoint"
OTHER_MODES = [f"trainer.parallel.{name}" for name in ("ddp", "dp", "fsdp", "hsdp", "zero", "zero_torch")]
# The optional kernels' packages (issue 50): imported only by a run whose train.float8 or
# train.loss_kernel=fused asks for them
OPTIONAL_KERNELS = ["torchao", "liger_kernel"]

# Loaded by every process the test starts (PYTHONPATH): the first import of each watched module
# appends {"module", "stack"} to $DTRAIN_TEST_IMPORTS; at exit, which of them the process holds.
WATCH_IMPORTS = """
import atexit, json, os, sys, traceback
_WATCHED = set(os.environ["DTRAIN_TEST_WATCH"].split(","))
_LOG = os.environ["DTRAIN_TEST_IMPORTS"]

def _write(record):
    with open(_LOG, "a") as log:
        log.write(json.dumps(record) + "\\n")

class _Watch:
    def find_spec(self, name, path=None, target=None):
        if name in _WATCHED and name not in sys.modules:
            _WATCHED.discard(name)
            _write({"module": name, "stack": [f"{f.filename}:{f.name}" for f in traceback.extract_stack()]})
        return None

sys.meta_path.insert(0, _Watch())
atexit.register(lambda: _write({"loaded": sorted(m for m in os.environ["DTRAIN_TEST_WATCH"].split(",")
                                                 if m in sys.modules)}))
"""


def watched_env(tmp_path: Path, modules: list[str]) -> tuple[dict, Path]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(WATCH_IMPORTS)
    log = tmp_path / "imports.jsonl"
    log.unlink(missing_ok=True)
    env = dtrain_env()
    env.update(PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]), DTRAIN_TEST_WATCH=",".join(modules),
               DTRAIN_TEST_IMPORTS=str(log))
    return env, log


def read_log(log: Path) -> tuple[dict[str, list[str]], list[str]]:
    """({module: the stack that first imported it}, the watched modules loaded at exit)."""
    stacks, loaded = {}, None
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "module" in record:
            stacks[record["module"]] = record["stack"]
        else:
            loaded = record["loaded"]
    assert loaded is not None, "the process did not exit through Python's atexit"
    return stacks, loaded


def test_the_one_process_run_path_imports_no_checkpoint_or_other_mode(tmp_path):
    """What a one-process run imports before its first step: the worker, the loop, the launch checks
    (the memory plan's meta model included), parallel=none's Strategy. Neither DCP, nor another mode's
    module, nor torch._dynamo (the optimizer imports that one later, see docs/performance.md)."""
    env, log = watched_env(tmp_path, [DCP, "torch.distributed.tensor", "torch._dynamo", *OTHER_MODES,
                                      *OPTIONAL_KERNELS])
    code = ("import trainer.fit.worker, trainer.commands.train\n"
            "from trainer.config.compose import compose\n"
            "from trainer.plan.memory import checkpoint_bytes\n"
            "from trainer.parallel import strategy_class\n"
            "assert strategy_class('none').name == 'none'\n"
            "checkpoint_bytes(compose(['model=tiny']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stacks, loaded = read_log(log)
    assert loaded == [], {m: stacks.get(m, [])[-8:] for m in loaded}


@pytest.mark.slow
def test_a_one_process_run_imports_dcp_only_to_save(data_dir, tmp_path):
    """A real 1-step run: its step is logged, then its end-of-run save is what imports DCP."""
    env, log = watched_env(tmp_path, [DCP, *OTHER_MODES, *OPTIONAL_KERNELS])
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "train.max_steps=1", "checkpoint.interval=0"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 1/1" in proc.stdout
    stacks, loaded = read_log(log)
    assert loaded == [DCP]  # the save needs it; no other mode's module was imported
    manager = str(REPO / "trainer" / "checkpoint" / "manager.py")
    assert any(frame.startswith(f"{manager}:save") for frame in stacks[DCP]), stacks[DCP][-10:]


def test_strategies_are_found_one_mode_at_a_time():
    assert strategy_class("none").name == "none"
    assert set(STRATEGIES) == {"none", "dp", "ddp", "fsdp", "hsdp", "zero", "zero_torch"}
    assert all(STRATEGIES[name].name == name for name in STRATEGIES)
    assert STRATEGIES.get("base") is None and STRATEGIES.get("muon") is None and "nonexistent" not in STRATEGIES
    with pytest.raises(KeyError):
        strategy_class("nonexistent")


def test_the_room_check_at_the_start_counts_the_checkpoint_bytes():
    """The start's room check counts the module's own tensors (no DCP): the same bytes as the
    model state the save writes, the tied embedding once."""
    cfg = compose(["model=tiny"])
    model = build_model(cfg.model)
    strategy = make_strategy(cfg.parallel, cfg.train, ONE_CPU_PROCESS)
    assert module_state_bytes(model) == state_bytes(strategy.model_state_dict(model))
    assert module_state_bytes(model) < state_bytes(model.state_dict())  # the tied embedding once


# --- offline `dtrain eval --tasks` --------------------------------------------------------------

needs_harness = pytest.mark.skipif(task_data.built_in_root() is None, reason="lm-evaluation-harness not installed")


def keep_hellaswag_file(cache: Path) -> None:
    """What the task index's cache keeps for the built-in hellaswag (the whole index takes seconds)."""
    root = task_data.built_in_root()
    task_data.keep_task_files(task_data.task_files_path(cache / "lm_eval_tasks", task_data.index_stem(root)),
                              {"hellaswag": str(root / "hellaswag" / "hellaswag.yaml")})


@needs_harness
def test_uncached_data_is_told_from_the_caches(tmp_path, monkeypatch):
    cache, hf_home = tmp_path / "dtrain", tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    assert task_data.uncached_data(["hellaswag"], cache / "lm_eval_tasks") == []  # nothing kept: the harness decides
    keep_hellaswag_file(cache)
    assert task_data.uncached_data(["hellaswag"], cache / "lm_eval_tasks") == [("hellaswag", "Rowan/hellaswag")]
    assert task_data.uncached_data(["hellaswag", "not_kept"], cache / "lm_eval_tasks") == []
    for kept in (hf_home / "datasets" / "Rowan___hellaswag", hf_home / "hub" / "datasets--Rowan--hellaswag"):
        kept.mkdir(parents=True)
        assert task_data.uncached_data(["hellaswag"], cache / "lm_eval_tasks") == []
        kept.rmdir()


def test_a_task_yaml_names_its_dataset_through_includes(tmp_path):
    (tmp_path / "_base.yaml").write_text("dataset_path: org/data\nprocess_docs: !function utils.process\n")
    (tmp_path / "task.yaml").write_text("include: _base.yaml\ntask: t\n")
    (tmp_path / "files.yaml").write_text("task: f\ndataset_path: json\ndataset_kwargs:\n  data_files: x.jsonl\n")
    (tmp_path / "python.yaml").write_text("task: p\nclass: !function tasks.Mine\n")
    assert task_data._dataset(tmp_path / "task.yaml") == "org/data"
    assert task_data._dataset(tmp_path / "files.yaml") is None
    assert task_data._dataset(tmp_path / "python.yaml") is None


@needs_harness
def test_offline_uncached_task_is_one_line_before_the_harness(tmp_path):
    """`dtrain eval RUN --tasks hellaswag` offline with its data in no cache: one `error:` line naming
    the dataset, exit 2, nothing written, lm_eval never imported."""
    run = tmp_path / "run"
    cfg = compose(["model=tiny"])
    write_config_record(run, to_dict(cfg))
    torch.save(build_model(cfg.model).state_dict(), run / "weights.pt")
    cache = tmp_path / "dtrain"
    keep_hellaswag_file(cache)
    env, log = watched_env(tmp_path, ["lm_eval", DCP])
    env.update(DTRAIN_CACHE_DIR=str(cache), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        env.pop(var, None)
    before = sorted(p.name for p in run.iterdir())
    proc = run_dtrain(["eval", str(run), "--tasks", "hellaswag", f"ckpt={run / 'weights.pt'}"], env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "hellaswag's (Rowan/hellaswag) data" in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
    assert sorted(p.name for p in run.iterdir()) == before
    assert read_log(log)[1] == []
