"""`dtrain eval RUN --tasks T` builds lm-evaluation-harness's task index once per command, and the
built-in part of it once per installed harness.

Building the index parses every task YAML the harness ships (~14k files, seconds), and it used to
happen twice: in the driver, which checks the task names before anything is written, and again in
the worker; and again in every later command. Counted for real: a sitecustomize (loaded by the
driver and by every spawned worker) records each process that opens a YAML file which only an index
build reads (an --include-path task no command asks for, a built-in task), through Python's audit
hook on `open`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.dtrain import REPO, dtrain_env, run_dtrain

from trainer.config.compose import compose
from trainer.config.schema import to_dict
from trainer.model.gpt import build_model
from trainer.preflight.rundir import write_config_record
from trainer.tokenizers.gpt2 import cached_ranks_path

harness_tasks = pytest.importorskip("lm_eval.tasks")

COUNT_OPENS = """
import os, sys
_SENTINELS = set(os.environ["DTRAIN_TEST_SENTINEL"].split(os.pathsep))
_LOG = os.environ["DTRAIN_TEST_OPENS"]

def _count(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.fspath(args[0]) in _SENTINELS:
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()} {os.fspath(args[0])}\\n")

sys.addaudithook(_count)
"""


@pytest.fixture(scope="module")
def setup(module_tmp) -> tuple[Path, Path, Path]:
    """(a run dir with a tiny model's weights as a state_dict file, a folder of task YAMLs, the
    YAML in it that no command here asks for: only an index build opens it)."""
    root = module_tmp.mktemp("startup")
    run = root / "run"
    torch.manual_seed(0)
    cfg = compose(["model=tiny"])
    write_config_record(run, to_dict(cfg))
    torch.save(build_model(cfg.model).state_dict(), run / "weights.pt")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "gen.jsonl").write_text("".join(json.dumps({"question": f"ROMEO {i}:", "answer": "x"}) + "\n"
                                             for i in range(4)))
    for name in ("dtrain_gen", "dtrain_unused"):
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
            'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
            'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n")
    return run, tasks, (tasks / "dtrain_unused.yaml").resolve()


BUILT_IN = Path(harness_tasks.__file__).parent / "hellaswag" / "hellaswag.yaml"


def count_opens(setup, tmp_path: Path, world: int, cache: Path) -> dict[Path, list[str]]:
    """Run `dtrain eval --tasks dtrain_gen` at `world` with DTRAIN_CACHE_DIR=`cache`: sentinel
    YAML -> the processes that opened it (an index build reads both: ours, then the harness's)."""
    run, tasks, sentinel = setup
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(COUNT_OPENS)
    opens = tmp_path / "opens.txt"
    opens.unlink(missing_ok=True)
    env = dtrain_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]),
               DTRAIN_TEST_SENTINEL=os.pathsep.join([str(sentinel), str(BUILT_IN)]), DTRAIN_TEST_OPENS=str(opens),
               DTRAIN_CACHE_DIR=str(cache))
    proc = run_dtrain(["eval", str(run), "--tasks", "dtrain_gen", "--include-path", str(tasks), "--batch-size", "2",
                       "--device", "cpu", f"ckpt={run / 'weights.pt'}", f"world={world}",
                       "launch.threads_per_worker=1"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((run / "eval_harness.json").read_text())
    assert record["world"] == world and record["requests"] == {"generate_until": 4}
    assert "exact_match,none" in record["results"]["dtrain_gen"]
    found: dict[Path, list[str]] = {sentinel: [], BUILT_IN: []}
    for line in opens.read_text().splitlines() if opens.exists() else []:
        pid, path = line.split(" ", 1)
        found[Path(path)].append(pid)
    return found


def a_cache(tmp_path: Path) -> Path:
    """A new DTRAIN_CACHE_DIR holding only the GPT-2 ranks (so nothing is fetched)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(cached_ranks_path(), cache / cached_ranks_path().name)
    return cache


def built_once(found: dict[Path, list[str]]) -> None:
    for sentinel, pids in found.items():
        assert len(pids) == 1, f"{sentinel.name} was indexed by processes {pids}"


@pytest.mark.slow
def test_the_task_index_is_built_once_by_two_workers(setup, tmp_path):
    built_once(count_opens(setup, tmp_path, 2, a_cache(tmp_path)))


@pytest.mark.slow
def test_the_next_command_reads_the_built_in_index_from_the_cache(setup, tmp_path):
    cache = a_cache(tmp_path)
    built_once(count_opens(setup, tmp_path, 1, cache))  # one worker, in the driver: built once, and kept
    assert list((cache / "lm_eval_tasks").glob("*.pickle"))
    second = count_opens(setup, tmp_path, 1, cache)
    assert second[BUILT_IN] == [], "the built-in task index was built again"
    assert len(second[setup[2]]) == 1  # --include-path is indexed afresh: the user's folder may change
