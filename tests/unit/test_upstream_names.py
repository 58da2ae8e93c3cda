"""The private names dtrain still uses from its dependencies (issue 34 item 7), one test each, so an
upgrade that renames or removes one fails here, naming it, instead of somewhere in a run. Each is
used in one module only, with the reason there; Hydra's are gone (trainer/config/compose.py and
trainer/commands/train.py use hydra.main, hydra.compose and the override parser only).

Each name, where it is used, and why no public API serves:
- `torch.serialization._get_layout` (checkpoint/verify.py): DCP's index pickles layouts as calls
  to it; the restricted unpickler must allow exactly it.
- `StorageMeta.load_id`, `FileSystemReader.load_id`, `read_metadata(rank=)` (checkpoint/verify.py):
  the verified reader hands DCP the index it checked, filled as DCP's own reader fills it.
- `TORCHELASTIC_USE_AGENT_STORE`, an environment switch (runtime.py): whether the agent's store is
  there to prefix per restart attempt (FACTS.md: elastic restarts).
- `tiktoken.Encoding._mergeable_ranks` (tokenizers/gpt2.py, tokenizers/hf_files.py): the BPE ranks, to
  cache the vocabulary offline and build the Hugging Face tokenizer.
- `torch._foreach_mul_`, `torch._foreach_add_` (muon.py): one kernel launch per family of
  matrices, torch.optim's own path.
- `lm_eval.tasks._index` (`Kind`, `TaskIndex`), `TaskManager._index` and `_all_*`
  (evals/task_index.py): the harness builds its task index in TaskManager.__init__ only; dtrain
  adopts a cached one.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import tiktoken
import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta


def test_torch_serialization_get_layout():
    assert torch.serialization._get_layout("torch.strided") is torch.strided


def test_dcp_reader_load_id_and_rank_keyword(tmp_path):
    assert "load_id" in StorageMeta.__dataclass_fields__
    assert hasattr(FileSystemReader(str(tmp_path)), "load_id")
    assert "kwargs" in inspect.signature(FileSystemReader.read_metadata).parameters


def test_elastic_agent_store_switch():
    from torch.distributed.elastic.agent.server import local_elastic_agent  # the agent's module, read as text

    assert "TORCHELASTIC_USE_AGENT_STORE" in inspect.getsource(local_elastic_agent)


def test_tiktoken_mergeable_ranks():
    assert "self._mergeable_ranks" in inspect.getsource(tiktoken.Encoding.__init__)


def test_torch_foreach_in_place_ops():
    a, b = [torch.ones(2)], [torch.ones(2)]
    torch._foreach_mul_(a, 2.0)
    torch._foreach_add_(a, b)
    assert a[0].tolist() == [3.0, 3.0]


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="the harness extra (dtrain[harness]) is absent")
def test_lm_eval_task_index_names():
    from lm_eval.tasks import TaskManager  # the optional extra dtrain[harness]

    from trainer.evals.task_index import MANAGER_FIELDS

    index = pytest.importorskip("lm_eval.tasks._index", reason="lm-eval < 0.4.10 has no index class (no cache)")
    assert {"TASK", "PY_TASK", "GROUP", "TAG"} <= {k.name for k in index.Kind} and index.TaskIndex
    init = inspect.getsource(TaskManager.__init__)
    assert all(f"self.{field}" in init for field in MANAGER_FIELDS), MANAGER_FIELDS
