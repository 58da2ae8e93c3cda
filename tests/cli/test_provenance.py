"""A run's summary names what produced it (issue 37 item 3): dtrain's version and the checkout's
commit, torch's version, the device's name and count, the world size; the summary table says so."""

from __future__ import annotations

import subprocess
from importlib.metadata import version

import torch
from helpers.dtrain import REPO, read_metrics
from helpers.runs import REFERENCE_BATCH, on_reference_steps

import trainer
from trainer.observe.provenance import describe, git_commit


def test_the_summary_names_what_ran(shared_run):
    run_dir, stdout = shared_run(*REFERENCE_BATCH, *on_reference_steps("ddp"))
    record = [r for r in read_metrics(run_dir) if "summary" in r][-1]
    ran = record["ran"]  # beside the summary's figures, which trackers log, not among them
    assert "ran" not in record["summary"]
    assert ran["dtrain"] == version("dtrain") == trainer.__version__ and ran["torch"] == torch.__version__
    assert ran["world"] == 2 and ran["device_count"] == 2 and ran["device"]
    assert ran["kernels"]["attention"] == "auto"
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert head.stdout.startswith(ran["git"].removesuffix("-dirty")), ran
    assert "ran with" in stdout and f"world {ran['world']}" in describe(ran)


def test_git_commit_outside_a_checkout_is_none(tmp_path):
    assert git_commit(tmp_path) is None
