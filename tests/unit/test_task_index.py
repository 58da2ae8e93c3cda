"""The harness's task index kept between commands (trainer/evals/task_index.py): the cached index
is the one the harness builds itself, a change to any task YAML builds it again, a damaged cache
file is rebuilt, and a cache that cannot be written costs only time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from trainer.evals import task_index  # noqa: E402
from trainer.evals.task_data import fingerprint  # noqa: E402
from trainer.evals.task_index import TaskIndex, built_in_index  # noqa: E402

pytestmark = pytest.mark.skipif(TaskIndex is None, reason="this lm-eval has no TaskIndex (before 0.4.10): no cache")

TASK = """task: {name}
tag: [{tag}]
dataset_path: json
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
"""


def task_folder(root: Path) -> Path:
    """Three tasks under two tags and a group over two of them, in nested folders."""
    (root / "deep").mkdir(parents=True)
    (root / "a.yaml").write_text(TASK.format(name="task_a", tag="tag_one"))
    (root / "b.yaml").write_text(TASK.format(name="task_b", tag="tag_one"))
    (root / "deep" / "c.yaml").write_text(TASK.format(name="task_c", tag="tag_two"))
    (root / "deep" / "group.yaml").write_text("group: group_ac\ntask: [task_a, task_c]\n")
    return root


@pytest.fixture
def builds(monkeypatch) -> list:
    """The roots each real TaskIndex.build call indexed."""
    calls, build = [], TaskIndex.build

    def counted(paths, **kwargs):
        paths = list(paths)
        calls.append(paths)
        return build(paths, **kwargs)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(counted))
    return calls


def test_fingerprint_follows_every_task_yaml(tmp_path):
    root = task_folder(tmp_path / "tasks")
    seen = {fingerprint(root)}
    (root / "notes.py").write_text("# not a task file\n")
    assert fingerprint(root) in seen
    (root / "b.yaml").write_text(TASK.format(name="task_b", tag="tag_two"))  # an edit
    seen.add(fingerprint(root))
    stat = (root / "a.yaml").stat()
    os.utime(root / "a.yaml", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # the same bytes, touched
    seen.add(fingerprint(root))
    (root / "deep" / "d.yaml").write_text(TASK.format(name="task_d", tag="tag_two"))  # a new file
    seen.add(fingerprint(root))
    (root / "deep" / "d.yaml").unlink()
    (root / "deep" / "c.yaml").rename(root / "c.yaml")  # a moved file
    seen.add(fingerprint(root))
    assert len(seen) == 5


def test_the_cached_index_is_the_built_one_and_damage_rebuilds_it(builds, tmp_path):
    root, cache = task_folder(tmp_path / "tasks"), tmp_path / "cache"
    fresh = TaskIndex.build([root])
    builds.clear()
    assert built_in_index(root, cache) == fresh and len(builds) == 1  # built and kept
    assert built_in_index(root, cache) == fresh and len(builds) == 1  # read back, nothing parsed
    assert {"task_a", "task_b", "task_c", "tag_one", "tag_two", "group_ac"} <= set(fresh)

    (kept,) = cache.glob("*.pickle")
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 0xFF
    kept.write_bytes(bytes(data))
    assert built_in_index(root, cache) == fresh and len(builds) == 2  # damaged: built again, kept again
    assert built_in_index(root, cache) == fresh and len(builds) == 2

    (root / "a.yaml").write_text(TASK.format(name="task_a2", tag="tag_one"))  # the folder changed
    again = built_in_index(root, cache)
    assert "task_a2" in again and "task_a" not in again and len(builds) == 3
    assert len(list(cache.glob("*.pickle"))) == 1, "the index of the files before the edit was left behind"


def test_an_unwritable_cache_costs_only_time(builds, tmp_path):
    root, blocked = task_folder(tmp_path / "tasks"), tmp_path / "a_file"
    blocked.write_text("a file where the cache folder would be\n")
    fresh = TaskIndex.build([root])
    assert built_in_index(root, blocked) == fresh
    assert built_in_index(root, blocked) == fresh and len(builds) == 3


def test_each_installed_task_folder_has_its_own_entry(tmp_path):
    """Entries hold absolute paths: two copies of the same files (two environments) never share one."""
    cache = tmp_path / "cache"
    one, two = task_folder(tmp_path / "one"), task_folder(tmp_path / "two")
    assert built_in_index(one, cache)["task_a"].yaml_path.parent == one
    assert built_in_index(two, cache)["task_a"].yaml_path.parent == two
    assert built_in_index(one, cache)["task_a"].yaml_path.parent == one
    assert len(list(cache.glob("*.pickle"))) == 2


@pytest.mark.slow
def test_the_task_manager_equals_the_harness_own(monkeypatch, tmp_path):
    """The harness's ~14k built-in YAMLs, cached, plus an --include-path folder that overrides a
    built-in name: the same index, name lists and task loading as TaskManager builds itself."""
    monkeypatch.setenv("DTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    include = task_folder(tmp_path / "tasks")
    (include / "deep" / "override.yaml").write_text(TASK.format(name="hellaswag", tag="tag_two"))
    theirs = TaskManager(include_path=str(include))
    for _ in range(2):  # built and kept, then read back
        ours = task_index.task_manager(str(include))
        assert ours.task_index == theirs.task_index
        assert ours.task_index["hellaswag"].yaml_path == include / "deep" / "override.yaml"
        for names in ("all_tasks", "all_subtasks", "all_groups", "all_tags"):
            assert getattr(ours, names) == getattr(theirs, names), names
        assert ours.match_tasks(["group_ac", "tag_one", "arc_easy", "nonsense"]) == \
            theirs.match_tasks(["group_ac", "tag_one", "arc_easy", "nonsense"])
    assert len(list((tmp_path / "cache" / "lm_eval_tasks").glob("*.pickle"))) == 1
