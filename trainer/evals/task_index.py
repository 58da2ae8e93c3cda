"""lm-evaluation-harness's task index, built once per installed harness instead of once per command.

A `TaskManager` parses every task YAML the harness ships (~14k files) into an index of names before
it can tell a task from a typo: seconds on every `dtrain eval --tasks` (and every `lm_eval` run),
although those files change only when the harness is installed again. So the built-in part of the
index is kept in `<cache>/lm_eval_tasks/` ($DTRAIN_CACHE_DIR, else ~/.cache/dtrain), under the
harness's version and a fingerprint of its task folder (every YAML's path, size and mtime: an edit,
a new file or a removed one makes a new entry), with a checksum that is verified before the file is
unpickled. The user's --include-path folders are indexed afresh each time and override built-in
names exactly as the harness merges them (later folders win). The result is a TaskManager whose
index equals the one the harness builds itself (tests/unit/test_task_index.py compares them).

Where the harness's TaskManager is not the one this was written against (lm-eval before 0.4.10
kept its index under other names), or the cache folder cannot be written, it is built as the
harness builds it: slower, never different.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections import defaultdict
from itertools import chain
from pathlib import Path

import lm_eval.tasks as harness_tasks
from lm_eval.tasks import TaskManager

from trainer.evals.task_data import folder_key, index_stem, keep_task_files, task_files_path
from trainer.io import write_atomic
from trainer.tokenizers.gpt2 import cache_dir

try:  # lm-eval >= 0.4.10: the index as its own class, entries by kind
    from lm_eval.tasks._index import Kind, TaskIndex
except ImportError:  # older harnesses: their TaskManager as it is (no cache)
    Kind = TaskIndex = None

log = logging.getLogger(__name__)
BUILT_IN = Path(harness_tasks.__file__).parent
DIGEST_BYTES = 32
# What adopting a prebuilt index sets: TaskManager.__init__'s own attributes in lm-eval 0.4.10+.
MANAGER_FIELDS = ("_index", "_all_tasks", "_all_subtasks", "_all_groups", "_all_tags")


def task_manager(include_path: str | None) -> TaskManager:
    """The harness's TaskManager over its built-in tasks and `include_path`, the built-in index from
    the cache when it is there (and put there when it is not)."""
    plain = TaskManager(include_path=None, include_defaults=False)  # an empty index: no YAML parsed
    if TaskIndex is None or not all(hasattr(plain, name) for name in MANAGER_FIELDS):
        return TaskManager(include_path=include_path)
    index = dict(built_in_index())
    for name, entry in TaskIndex.build([Path(include_path)] if include_path else []).items():
        if name in index:  # the harness's own merge: a later folder overrides, and says so
            log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                        index[name].yaml_path)
        index[name] = entry
    plain.include_path = include_path
    _adopt(plain, index)
    return plain


def built_in_index(root: Path = BUILT_IN, folder: Path | None = None) -> dict:
    """The index of the task YAMLs under `root` (the harness's own by default), from `folder`
    (default <cache>/lm_eval_tasks) when an intact copy for exactly these files is there."""
    folder = folder or cache_dir() / "lm_eval_tasks"
    stem = index_stem(root)
    path = folder / f"{stem}.pickle"
    index = _read(path)
    if index is None:
        index = TaskIndex.build([root])
        _write(path, index, stale=f"{folder_key(root)}-*")
    task_files = task_files_path(folder, stem)
    if not task_files.exists():  # what task_data.py reads to tell offline that a task's data is missing
        keep_task_files(task_files, {name: str(entry.yaml_path) for name, entry in index.items()
                                     if entry.kind == Kind.TASK})
    return index


def _read(path: Path) -> dict | None:
    """The cached index, or None when there is none or it does not match its checksum."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    digest, payload = data[:DIGEST_BYTES], data[DIGEST_BYTES:]
    if hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() != digest:
        log.warning("the cached task index %s is damaged; building it again", path)
        return None
    return pickle.loads(payload)


def _write(path: Path, index: dict, stale: str) -> None:
    """Keep `index` at `path` (checksum first), removing the files matching `stale` (the same
    folder's index before its files changed); a cache that cannot be written costs only time."""
    payload = pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob(stale):
            old.unlink(missing_ok=True)
        write_atomic(path, hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() + payload)
    except OSError as err:
        log.warning("could not keep the task index in %s (%s); it is built again next time", path.parent, err)


def _adopt(manager: TaskManager, index: dict) -> None:
    """Give `manager` the prebuilt `index` with the name lists TaskManager.__init__ derives from it."""
    buckets = defaultdict(list)
    for name, entry in index.items():
        buckets[entry.kind].append(name)
    manager._index = index
    manager._all_tasks = sorted(index)
    manager._all_subtasks = sorted(chain.from_iterable(buckets[k] for k in (Kind.TASK, Kind.PY_TASK)))
    manager._all_groups = sorted(buckets[Kind.GROUP])
    manager._all_tags = sorted(buckets[Kind.TAG])
