"""What every dtrain process sets up before torch starts: the thread and MKL settings that bitwise
resume needs (a user's own values win), and Python stacks on a native crash."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.dtrain import REPO, dtrain_env, tiny_args

MKL_CBWR_BRANCH, MKL_CBWR_AUTO, MKL_CBWR_COMPATIBLE = 1, 2, 3  # mkl.h's values
SETTINGS = ("OMP_DYNAMIC", "MKL_DYNAMIC", "MKL_CBWR")
PROBE = f"""
import ctypes, json, os
import trainer, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
env = {{k: os.environ.get(k) for k in {SETTINGS!r}}}
print(json.dumps({{"env": env, "cbwr": lib.mkl_serv_cbwr_get({MKL_CBWR_BRANCH})}}))
"""


def mkl_reports_its_mode() -> bool:
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return False
    return hasattr(lib, "mkl_serv_cbwr_get")


@pytest.mark.skipif(not mkl_reports_its_mode(), reason="this torch build has no MKL to ask for its mode")
@pytest.mark.parametrize("given", [None, "COMPATIBLE"])
def test_reproducibility_settings_are_in_place_before_torch_loads(given):
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    if given:
        env["MKL_CBWR"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    assert seen["env"]["OMP_DYNAMIC"] == "FALSE" and seen["env"]["MKL_DYNAMIC"] == "FALSE"
    # MKL read the mode when torch loaded it: the value trainer/__init__.py set, or the user's
    assert seen["cbwr"] == (MKL_CBWR_COMPATIBLE if given else MKL_CBWR_AUTO), seen


def test_a_native_crash_shows_the_python_stack(data_dir, tmp_path):
    """A real SIGSEGV to a one-process run: the stack it died in, not only 'Segmentation fault'."""
    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=100000")
    env = {k: v for k, v in dtrain_env().items() if k != "PYTHONFAULTHANDLER"}  # dtrain's own doing
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().count("loss") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGSEGV)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in stderr, stderr[-2000:]
    assert "trainer/fit/loop.py" in stderr, stderr[-3000:]
