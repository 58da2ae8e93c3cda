"""`dtrain eval RUN --tasks T` builds lm-evaluation-harness's task index once per command.

Building the index parses every task YAML the harness ships (~14k files, seconds), and it used to
happen twice: in the driver, which checks the task names before anything is written, and again in
the worker. Counted for real: a sitecustomize (loaded by the driver and by every spawned worker)
records each process that opens a YAML file which only an index build reads, through Python's
audit hook on `open`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, dtrain_env, run_dtrain

from trainer.compose import compose
from trainer.config import to_dict
from trainer.model import build_model
from trainer.rundir import write_config_record

pytest.importorskip("lm_eval")

COUNT_OPENS = """
import os, sys
_SENTINEL, _LOG = os.environ["DTRAIN_TEST_SENTINEL"], os.environ["DTRAIN_TEST_OPENS"]

def _count(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)) and os.fspath(args[0]) == _SENTINEL:
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()}\\n")

sys.addaudithook(_count)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a run dir with a tiny model's weights as a state_dict file, a folder of task YAMLs, the
    YAML in it that no command here asks for: only an index build opens it)."""
    root = tmp_path_factory.mktemp("startup")
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


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_the_task_index_is_built_once_per_command(world, setup, tmp_path):
    run, tasks, sentinel = setup
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(COUNT_OPENS)
    opens = tmp_path / "opens.txt"
    env = dtrain_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(hook), str(REPO)]),
               DTRAIN_TEST_SENTINEL=str(sentinel), DTRAIN_TEST_OPENS=str(opens))
    proc = run_dtrain(["eval", str(run), "--tasks", "dtrain_gen", "--include-path", str(tasks), "--batch-size", "2",
                       "--device", "cpu", f"ckpt={run / 'weights.pt'}", f"world={world}",
                       "launch.threads_per_worker=1"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((run / "eval_harness.json").read_text())
    assert record["world"] == world and record["requests"] == {"generate_until": 4}
    assert "exact_match,none" in record["results"]["dtrain_gen"]
    assert len(opens.read_text().split()) == 1, f"the task index was built by processes {opens.read_text().split()}"
