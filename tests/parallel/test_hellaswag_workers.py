"""HellaSwag with several workers: the same counts at world 1, 2 (fsdp) and 4 (torchrun), and logged
during ddp training then `dtrain eval` of its checkpoint (tests/unit/test_hellaswag.py checks the
scoring in-process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.dtrain import REPO, dtrain_env, read_metrics, run_dtrain, tiny_args


def _eval_cli(hellaswag_run, world: int, mode: str, torchrun: bool) -> dict:
    run_dir = hellaswag_run["run_dir"]
    args = ["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}",
            f"eval.hellaswag.path={hellaswag_run['files']['all']}", "eval.hellaswag.batch_examples=5",
            f"parallel={mode}"]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "trainer", *args]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dtrain_env())
    else:
        proc = run_dtrain([*args, f"world={world}"])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads((run_dir / "eval_hellaswag.json").read_text())


@pytest.mark.slow
def test_same_counts_for_world_1_2_4(hellaswag_run):
    """91 examples in batches of 5: at world 2 rank 1 runs a dummy forward (46 vs 45 examples), which
    FSDP needs to not hang; world 4 runs under plain torchrun."""
    results = {}
    for world, mode, torchrun in ((1, "none", False), (2, "fsdp", False), (4, "ddp", True)):
        r = _eval_cli(hellaswag_run, world, mode, torchrun)
        assert (r["world"], r["parallel"]) == (world, mode)
        results[world] = (r["hellaswag_n"], r["hellaswag_correct"], r["hellaswag_correct_norm"],
                          r["hellaswag_acc"], r["hellaswag_acc_norm"])
    assert results[1][0] == 91
    assert results[1] == results[2] == results[4], results


@pytest.mark.slow
def test_logged_during_ddp_training_and_eval_of_its_checkpoint(data_dir, hellaswag_run, tmp_path):
    """eval.hellaswag.interval under ddp world 2 logs the three keys every 10 steps and at the last; then
    `dtrain eval RUN_DIR` (no ckpt=: the newest checkpoint, written at the end of the run) scores
    the final weights on one process with exactly the counts logged at the last step."""
    run_dir = tmp_path / "run"
    hs = [f"eval.hellaswag.path={hellaswag_run['files']['all']}", "eval.limit=20"]
    proc = run_dtrain(tiny_args(data_dir, run_dir, "parallel=ddp", "world=2", "train.max_steps=15",
                                "eval.hellaswag.interval=10", "eval.hellaswag.batch_examples=3",
                                "checkpoint.interval=10", *hs))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    logged = [r for r in read_metrics(run_dir) if "hellaswag_acc" in r]
    assert [r["step"] for r in logged] == [10, 15]
    for r in logged:
        assert r["hellaswag_n"] == 20 and 0 <= r["hellaswag_acc"] <= 1 and 0 <= r["hellaswag_acc_norm"] <= 1

    proc = run_dtrain(["eval", str(run_dir), *hs])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    result = json.loads((run_dir / "eval_hellaswag.json").read_text())
    assert result["step"] == 15 and result["world"] == 1
    assert {k: result[k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")} == \
        {k: logged[-1][k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")}
    # the flags --tasks takes serve the built-in HellaSwag too: --step N (an older checkpoint than the
    # newest, so that a command reading the newest fails), --limit N
    proc = run_dtrain(["eval", str(run_dir), "--step", "10", "--limit", "7", hs[0]])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    result = json.loads((run_dir / "eval_hellaswag.json").read_text())
    assert result["step"] == 10 and result["hellaswag_n"] == 7
