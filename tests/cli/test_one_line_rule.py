"""The one-line rule with no exceptions (issue 29): every input a user can get wrong ends with one
`error:` line, exit code 2, no traceback, and nothing written (no run directory, no `.hydra/`, no
lock file, no dataset folder), the checks that need torch or a tracker included."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args
from helpers.errors import error_line

from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.errors import ConfigError
from trainer.fetch.hub import OFFLINE_VARS, PROXY_VARS, hub_unreachable
from trainer.prepare.pipeline import _locked


def train_args(data_dir: Path, *extra: str) -> list[str]:
    """tiny_args without its run directory (a case below names its own)."""
    return [a for a in tiny_args(data_dir, Path("unused")) if not a.startswith("hydra.run.dir=")] + list(extra)


# The discard port: nothing listens there, so a download fails at once, as offline.
DEAD_URL = "http://127.0.0.1:9/hellaswag_val.jsonl"

# Each refused before the run directory exists: name -> (overrides, a word the line must hold).
REFUSED_RUNS = {
    "name too long": (["hydra.run.dir={run}/" + "a" * 300], "255"),
    "unknown device": (["hydra.run.dir={run}", "train.device=tpu"], "train.device"),
    "+unknown key": (["hydra.run.dir={run}", "+foo=1"], "foo is not a config key"),
    "lr inf": (["hydra.run.dir={run}", "optim.lr=inf"], "optim.lr=inf must be a finite number"),
    "data.dir a file": (["hydra.run.dir={run}", "data.dir={file}"], "is a file"),
    "init_from a file": (["hydra.run.dir={run}", "model.init_from={file}"], "is a file"),
    # issue 45, finding 15: the run directory and its .hydra/ were made before the worker found out
    "hellaswag.path missing": (["hydra.run.dir={run}", "eval.hellaswag.interval=2",
                                "eval.hellaswag.path={run}.jsonl"], "is not a file"),
    "hellaswag offline": (["hydra.run.dir={run}", "eval.hellaswag.interval=2", f"eval.hellaswag.url={DEAD_URL}"],
                          "cannot download HellaSwag"),
    # issue 48: a window past the run's last step; the allocator's history on a CPU run (known once torch is up)
    "profile steps past max_steps": (["hydra.run.dir={run}", "train.profile.steps=[3,40]"],
                                     "train.profile.steps=[3,40] must be two step numbers"),
    "memory snapshot on the CPU": (["hydra.run.dir={run}", "train.device=cpu", "train.memory_snapshot=true"],
                                   "train.memory_snapshot=true needs a CUDA device"),
    # issue 50: an SDPA kernel the CPU has not (tried for real before anything is written)
    "attention kernel the CPU lacks": (["hydra.run.dir={run}", "train.device=cpu", "model.attention=cudnn"],
                                       "model.attention=cudnn has no kernel"),
    "fused loss on the CPU": (["hydra.run.dir={run}", "train.device=cpu", "train.loss_kernel=fused"],
                              "train.loss_kernel=fused runs liger-kernel's Triton kernels"),
    "unknown float8 recipe": (["hydra.run.dir={run}", "train.float8=e5m2"], "train.float8='e5m2' is unknown"),
    # issue 48: a straggler ratio that would name a rank as fast as the others
    "straggler ratio 1": (["hydra.run.dir={run}", "train.straggler_ratio=1"], "train.straggler_ratio=1"),
}


@pytest.mark.parametrize("case", list(REFUSED_RUNS))
def test_refused_run_writes_nothing(case, data_dir, tmp_path):
    overrides, needle = REFUSED_RUNS[case]
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    run = tmp_path / "run"
    line = error_line(run_dtrain(train_args(data_dir, *(o.format(run=run, file=a_file) for o in overrides))))
    assert needle in line
    assert "dtrain prepare" not in line  # a file in the way is not a dataset to prepare
    assert not run.exists()
    assert not (data_dir / "hellaswag").exists()  # nor an empty download folder in the data cache


# Issue 47: device-mesh sizes no run can lay out -> (overrides, a phrase the line must hold). tiny has 2 heads.
BAD_MESHES = {
    "product does not divide world": (["parallel=hsdp", "parallel.dp_replicate=3", "world=4"],
                                      "does not divide world=4"),
    "tp does not divide the heads": (["parallel=fsdp", "parallel.tp=3", "world=3"],
                                     "parallel.tp=3 does not divide model.n_head=2"),
    "tp with ddp": (["parallel=ddp", "parallel.tp=2", "world=2"], "parallel=fsdp parallel.tp=2"),
    "dp_replicate with fsdp": (["parallel=fsdp", "parallel.dp_replicate=2", "world=4"],
                               "use parallel=hsdp parallel.dp_replicate=2"),
    "cp with ddp": (["parallel=ddp", "parallel.cp=2", "world=2"], "use parallel=fsdp parallel.cp=2"),
    "cp does not cut seq_len into 2 x cp chunks": (["parallel=fsdp", "parallel.cp=3", "world=3", "train.seq_len=64"],
                                                   "choose a train.seq_len divisible by 6"),
}
# `dtrain plan` refuses them all: the mode asked for must lay out its mesh
PLAN_REFUSES = list(BAD_MESHES)


@pytest.mark.parametrize("case", list(BAD_MESHES))
def test_a_bad_mesh_is_one_line_and_writes_nothing(case, data_dir, tmp_path):
    overrides, needle = BAD_MESHES[case]
    run = tmp_path / "run"
    assert needle in error_line(run_dtrain(train_args(data_dir, f"hydra.run.dir={run}", *overrides)))
    assert not run.exists()


@pytest.mark.parametrize("case", PLAN_REFUSES)
def test_plan_refuses_a_bad_mesh_the_same_way(case, tmp_path):
    overrides, needle = BAD_MESHES[case]
    assert needle in error_line(run_dtrain(["plan", "model=tiny", *overrides], cwd=tmp_path))
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["product does not divide world", "tp with ddp"])
def test_plain_torchrun_refuses_a_bad_mesh_in_one_line(case, data_dir, tmp_path):
    """Under torchrun every rank checks before anything is written and exits 2 with the same line (the
    traceback torchrun prints is its own agent's ChildFailedError, not a worker's)."""
    overrides, needle = BAD_MESHES[case]
    run = tmp_path / "run"
    world = next(int(o.removeprefix("world=")) for o in overrides if o.startswith("world="))
    args = train_args(data_dir, f"hydra.run.dir={run}", *(o for o in overrides if not o.startswith("world=")))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                "-m", "trainer", *args]
    proc = subprocess.run(torchrun, cwd=REPO, capture_output=True, text=True, timeout=300, env=dtrain_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in out and "exitcode  : 1" not in out, out
    assert f'File "{REPO / "trainer"}' not in out, out  # no worker's traceback
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert 1 <= len(errors) <= world and len(set(errors)) == 1 and needle in errors[0], proc.stderr
    assert not run.exists()


def test_a_sweep_with_a_missing_hellaswag_file_writes_nothing(data_dir, tmp_path):
    """Issue 45, finding 15: each point found it missing in its own folder, after the sweep's was made."""
    sweep = tmp_path / "sweep"
    line = error_line(run_dtrain(["train", "-m", *train_args(data_dir)[1:], "optim.lr=1e-3,2e-3",
                                  "eval.hellaswag.interval=2", f"eval.hellaswag.path={tmp_path / 'hs.jsonl'}",
                                  f"hydra.sweep.dir={sweep}"]))
    assert "is not a file" in line
    assert not sweep.exists()


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.min_lr=-inf", "model.norm_eps=inf", "train.peak_flops=inf",
                                      "optim.betas=[0.9,inf]", "optim.muon.lr=inf", "parallel.bucket_cap_mb=inf",
                                      "launch.monitor_interval=inf", "data.val_fraction=-inf"])
def test_every_float_key_refuses_inf_and_nan(override):
    with pytest.raises(ConfigError, match="must be (a )?finite number"):
        validate(compose([override]))


def test_plus_key_is_the_same_line_as_key(data_dir, tmp_path):
    lines = {plus: error_line(run_dtrain(train_args(data_dir, f"hydra.run.dir={tmp_path / 'run'}", f"{plus}foo=1")))
             for plus in ("", "+", "++")}
    assert len(set(lines.values())) == 1, lines
    assert "+foo" not in lines[""]  # Hydra's own advice (`+foo=1`) would be refused as well
    assert not (tmp_path / "run").exists()


def test_empty_run_dir_is_refused_not_the_current_folder(data_dir, tmp_path):
    cwd = tmp_path / "my_files"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("mine\n")
    for key, extra in (("hydra.run.dir", []), ("hydra.sweep.dir", ["-m", "optim.lr=1e-3,2e-3"])):
        line = error_line(run_dtrain(train_args(data_dir, *extra, f"{key}="), cwd=cwd))
        assert f"{key}= is empty" in line
        assert sorted(p.name for p in cwd.iterdir()) == ["notes.txt"]


def test_cuda_without_cuda_writes_nothing(data_dir, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = error_line(run_dtrain(train_args(data_dir, f"hydra.run.dir={tmp_path / 'run'}", "train.device=cuda")))
    assert "no CUDA device" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_wandb_without_credentials_writes_nothing(data_dir, tmp_path):
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed")
    env = {k: v for k, v in dtrain_env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "no_netrc"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    run = tmp_path / "run"
    line = error_line(run_dtrain(train_args(data_dir, f"hydra.run.dir={run}", "logger=wandb"), env=env))
    assert "W&B credentials" in line and "WANDB_MODE=offline" in line
    assert not run.exists() and not (tmp_path / "home").exists()


def make_binary(path: Path) -> str:
    path.write_bytes(bytes(range(256)) * 8)
    return str(path)


def make_empty_folder(path: Path) -> str:
    path.mkdir()
    return str(path)


def make_empty_file(path: Path) -> str:
    path.write_text("")
    return str(path)


# name -> (data group, how to make the source under tmp_path, a word the line must hold)
FAILED_PREPARES = {
    "missing source": ("text", lambda p: str(p / "absent.txt"), "does not exist"),
    "empty folder": ("text", lambda p: make_empty_folder(p / "empty"), "no .txt files"),
    "folder for a file": ("tinyshakespeare", lambda p: make_empty_folder(p / "folder"), "is a folder"),
    "binary file": ("text", lambda p: make_binary(p / "blob.txt"), "not UTF-8"),
    "glob matching nothing": ("text", lambda p: str(p / "*.nomatch"), "matches no files"),
    "empty source": ("text", lambda p: make_empty_file(p / "empty.txt"), "has no text"),
}


@pytest.mark.parametrize("case", list(FAILED_PREPARES))
def test_failed_prepare_leaves_nothing(case, tmp_path):
    group, make_source, needle = FAILED_PREPARES[case]
    source = make_source(tmp_path)
    data = tmp_path / "data"
    line = error_line(run_dtrain(["prepare", f"data={group}", "data.name=x", f"data.source={source}",
                                  f"data.dir={data}"]))
    assert needle in line
    assert not data.exists()


def test_failed_prepare_in_an_existing_data_dir_leaves_it_as_it_was(tmp_path):
    data = tmp_path / "data"
    (data / "x").mkdir(parents=True)
    error_line(run_dtrain(["prepare", "data=text", "data.name=x", f"data.source={make_binary(tmp_path / 'b.txt')}",
                           f"data.dir={data}"]))
    assert list((data / "x").iterdir()) == []  # no .lock, no .prepare-* staging folder


def test_prepare_into_a_file_says_it_is_a_file(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    source = tmp_path / "corpus.txt"
    source.write_text("some text\n")
    line = error_line(run_dtrain(["prepare", "data=text", "data.name=x", f"data.source={source}",
                                  f"data.dir={a_file}"]))
    assert f"{a_file} is a file, not a folder" in line


def test_prepared_dataset_holds_no_lock_file(data_dir):
    assert not (data_dir / "corpus" / ".lock").exists()


def test_prepare_lock_is_exclusive_and_goes_with_its_maker(tmp_path):
    order = []

    def second():
        with _locked(tmp_path):
            order.append("second")

    with _locked(tmp_path):
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.3)
        order.append("first")  # the second is still waiting for the lock
    waiter.join(10)
    assert order == ["first", "second"]
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("command", [pytest.param(["eval"], marks=pytest.mark.slow), ["report"]])
def test_a_file_where_a_run_directory_is_expected(command, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    assert f"{a_file} is a file, not a folder" in error_line(run_dtrain([*command, str(a_file)]))


def test_hub_out_of_reach_is_known_at_once(monkeypatch):
    for var in (*OFFLINE_VARS, *PROXY_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    t0 = time.perf_counter()
    reason = hub_unreachable(timeout=2.0)
    assert reason and "127.0.0.1:9" in reason
    assert time.perf_counter() - t0 < 2.5
    assert all(os.environ[var] == "1" for var in OFFLINE_VARS)  # the workers inherit offline mode
    assert hub_unreachable() == "HF_HUB_OFFLINE is set"


def test_help_describes_export_as_it_is():
    proc = run_dtrain(["--help"])
    export = next(line for line in proc.stdout.splitlines() if line.strip().startswith("export"))
    assert "GPT-2, Llama or Qwen3" in export


@pytest.fixture(scope="module")
def trained_run(data_dir, module_tmp) -> Path:
    """A 2-step tiny run with a checkpoint (the resume and harness cases need one)."""
    run = module_tmp.mktemp("trained") / "run"
    run_dtrain(tiny_args(data_dir, run, "train.max_steps=2"), check=True)
    return run


@pytest.mark.slow
def test_resume_of_another_models_checkpoint_writes_nothing(data_dir, trained_run, tmp_path):
    run = tmp_path / "run"
    line = error_line(run_dtrain(tiny_args(data_dir, run, "model.n_layer=3", f"resume={trained_run}")))
    assert "written for another model" in line and "n_layer=2 vs 3" in line
    assert not run.exists()


@pytest.mark.slow
def test_eval_offline_leaves_no_folder_in_the_data_cache(trained_run, tmp_path):
    """Issue 45, finding 15: the failed download left an empty hellaswag/ folder behind."""
    cache = tmp_path / "data"
    cache.mkdir()
    line = error_line(run_dtrain(["eval", str(trained_run), f"eval.hellaswag.url={DEAD_URL}", f"data.dir={cache}"]))
    assert "cannot download HellaSwag" in line
    assert list(cache.iterdir()) == []
    assert not (trained_run / "eval_hellaswag.json").exists()


@pytest.mark.slow
def test_harness_offline_is_one_line_without_retries(trained_run, tmp_path):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-evaluation-harness is not installed")
    env = dtrain_env()
    # an empty cache, and a Hub endpoint that does not answer: offline as a machine without network is
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    for var in (*OFFLINE_VARS, *PROXY_VARS):
        env.pop(var, None)
    proc = run_dtrain(["eval", str(trained_run), "--tasks", "hellaswag"], env=env)
    line = error_line(proc)
    assert "out of reach" in line and "not in the cache" in line
    assert "Retrying" not in proc.stderr
    assert not (trained_run / "eval_harness.json").exists()
