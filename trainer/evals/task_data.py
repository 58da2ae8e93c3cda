"""Whether a built-in task's data can be read offline, answered before lm-evaluation-harness is imported.

Offline (trainer/fetch/hub.py), a task whose data is not cached can only fail, and finding that out
the harness's way (import it, build the task, let `datasets` look in its cache) takes seconds. So the
task index's cache (task_index.py) keeps beside each index the YAML file of every built-in task by
name; a task's YAML names its dataset (`dataset_path`, perhaps through an `include`), and the Hub's
and `datasets`' caches keep a dataset in a folder named after it. When no folder in either cache
bears the dataset's name, its data cannot be read offline and the command says so at once.
Whatever this cannot tell for sure (a group or tag, a task written in Python, data files or a local
folder, --include-path, a name it does not know, no index kept yet) is left to the harness: slower,
never different.

Standard library and PyYAML only: importing the harness is what this saves.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import yaml

from trainer.io import write_atomic
from trainer.tokenizers.gpt2 import cache_dir

# `datasets` builders that read files named in the YAML (dataset_kwargs), not a dataset on the Hub.
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder")
INCLUDE_DEPTH = 5


def not_cached(offline: str, what: str = "a task's data") -> str:
    """The line for task data that is not in the cache while the Hub is out of reach (`offline` says why)."""
    return (f"the harness could not fetch {what}: it is not in the cache (~/.cache/huggingface) and the Hugging "
            f"Face Hub is out of reach ({offline}); run it once with network access, or use local task YAMLs "
            "with --include-path")


def built_in_root() -> Path | None:
    """The harness's own task folder (None when the harness is not installed), found without importing it."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def folder_key(root: Path) -> str:
    """The part of a kept index's name that says which task folder it indexes (the entries hold
    absolute paths: one file per installed task folder, a venv each)."""
    return hashlib.blake2b(str(root.resolve()).encode(), digest_size=6).hexdigest()


def index_stem(root: Path) -> str:
    """The name (without suffix) the index of the task YAMLs under `root` is kept under: its folder,
    the harness's version and a fingerprint of its files."""
    return f"{folder_key(root)}-{importlib.metadata.version('lm_eval')}-{fingerprint(root)}"


def fingerprint(root: Path) -> str:
    """A digest of every task YAML under `root`: its path, size and modification time."""
    files = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".yaml"):
                stat = os.stat(os.path.join(folder, name))
                files.append(f"{os.path.relpath(os.path.join(folder, name), root)}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return hashlib.blake2b("\n".join(sorted(files)).encode(), digest_size=12).hexdigest()


def task_files_path(folder: Path, stem: str) -> Path:
    return folder / f"{stem}.tasks.json"


def keep_task_files(path: Path, task_files: dict[str, str]) -> None:
    """Write {task name: its YAML file} beside the index (a cache that cannot be written costs only time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(task_files, sort_keys=True))
    except OSError:
        pass


def uncached_data(tasks: list[str], folder: Path | None = None) -> list[tuple[str, str]]:
    """(task, dataset) for each of `tasks` whose data is surely in neither Hugging Face cache; empty
    unless every task is a built-in YAML task this can read (the harness then decides)."""
    root = built_in_root()
    if root is None or not root.is_dir():
        return []
    try:
        task_files = json.loads(task_files_path(folder or cache_dir() / "lm_eval_tasks", index_stem(root)).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(task_files, dict) or not all(t in task_files for t in tasks):
        return []
    datasets = {task: _dataset(Path(task_files[task])) for task in tasks}
    if any(d is None for d in datasets.values()):
        return []
    return [(task, d) for task, d in datasets.items() if not _cached(d)]


class _Loader(yaml.SafeLoader):
    """The harness's YAML tags (`!function module.name`) read as None: only plain keys matter here."""


def _tag_as_none(*_) -> None:
    return None


_Loader.add_multi_constructor("!", _tag_as_none)


def _dataset(path: Path, depth: int = 0) -> str | None:
    """The Hub dataset a task YAML reads (through its includes), or None when it reads anything else
    or cannot be told."""
    try:
        config = yaml.load(path.read_text(), Loader=_Loader)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(config, dict) or "class" in config or config.get("dataset_kwargs"):
        return None
    dataset = config.get("dataset_path")
    if dataset is None and depth < INCLUDE_DEPTH and isinstance(config.get("include"), str):
        return _dataset(path.parent / config["include"], depth + 1)
    if not isinstance(dataset, str) or dataset in FILE_BUILDERS or Path(dataset).expanduser().exists():
        return None
    return dataset


def _cached(dataset: str) -> bool:
    """Whether a folder in the Hub's or `datasets`' cache may hold `dataset` (any folder whose name
    contains the dataset's own name: a false "yes" only leaves the answer to the harness)."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    caches = [os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub",
              os.environ.get("HF_DATASETS_CACHE") or home / "datasets"]
    name = dataset.rsplit("/", 1)[-1].lower()
    for cache in caches:
        try:
            if any(name in entry.lower() for entry in os.listdir(Path(cache).expanduser())):
                return True
        except OSError:
            continue
    return False
