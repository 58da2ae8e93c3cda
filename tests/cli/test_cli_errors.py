"""Bad input ends with one clear line and exit code 2, no traceback, nothing overwritten."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args
from helpers.errors import assert_user_error


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its damaged shards and a batch larger
    than the data are sized for GPT-2's ~300k tokens."""
    return gpt2_data_dir


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.no_such_key=1", "no_such_key"),
        ("model=no_such_model", "available: cpu_small"),
        ("train.max_steps=many", "max_steps"),
        ("parallel=dp world=2", "parallel=dp"),
        ("train.total_batch_size=1000", "not divisible"),
        ("train.total_batch_size=2048 train.grad_accum_steps=3", "contradicts"),
        ("train.seq_len=4096", "block_size"),
        ("optim.min_lr=1.0", "optim.min_lr"),
        ("parallel.mode=tp", "parallel.mode"),
        ("train.dtype=float16", "bfloat16"),
    ],
)
def test_bad_config_is_one_line(override, needle, data_dir, tmp_path):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", *override.split()))
    assert_user_error(proc, needle)
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run dir


def test_unknown_command_and_flag():
    assert_user_error(run_dtrain(["fly"]), "unknown command")
    assert_user_error(run_dtrain(["train", "--fast"]), "unknown flag")


def test_help_and_cfg_job(data_dir):
    proc = run_dtrain(["--help"])
    assert proc.returncode == 0 and "train" in proc.stdout and "prepare" in proc.stdout
    proc = run_dtrain(["train", "model=tiny", "optim.lr=3e-4", "--cfg", "job"])
    assert proc.returncode == 0, proc.stderr
    assert "n_layer: 2" in proc.stdout and "lr: 0.0003" in proc.stdout


def test_missing_dataset_names_the_prepare_command(tmp_path):
    proc = run_dtrain(["train", "model=tiny", "data=text", "data.name=absent", f"data.dir={tmp_path}",
                       f"hydra.run.dir={tmp_path / 'run'}"])
    assert_user_error(proc, "dtrain prepare", "absent")


def test_corrupt_and_truncated_shards(data_dir, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(data_dir / "corpus", copy / "corpus")
    shard = copy / "corpus" / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[1000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    proc = run_dtrain(tiny_args(copy, tmp_path / "run1"))
    assert_user_error(proc, "train_000000.bin", "sha256")
    shard.write_bytes(bytes(raw[:-100]))
    proc = run_dtrain(tiny_args(copy, tmp_path / "run2"))
    assert_user_error(proc, "train_000000.bin", "size")


def test_batch_larger_than_the_data(data_dir, tmp_path):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "train.micro_batch_size=20000"))
    assert_user_error(proc, "training tokens")
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "parallel=ddp", "world=64",
                                "train.micro_batch_size=100"))
    assert_user_error(proc, "world")


def test_run_dir_with_another_runs_outputs_is_left_alone(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("theirs: true\n")
    proc = run_dtrain(tiny_args(data_dir, run_dir))
    assert_user_error(proc, "already holds")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "theirs: true\n"


def test_sharding_modes_at_world_one_warn_but_run(data_dir, tmp_path):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "parallel=fsdp", "train.max_steps=2"))
    assert proc.returncode == 0, proc.stderr
    assert "dtrain: parallel=fsdp with world=1 shards nothing" in " ".join(proc.stderr.split()), proc.stderr


@pytest.mark.slow
def test_unreachable_rendezvous_fails_within_bounded_time(data_dir, tmp_path):
    start = time.monotonic()
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", "parallel=ddp", "world=2", "launch.nnodes=2",
                                "launch.rdzv_endpoint=127.0.0.1:29811", "launch.rdzv_timeout=5"), timeout=120)
    assert_user_error(proc, "rendezvous", "127.0.0.1:29811")
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("command", ["train", "prepare", "eval", "sample", "export", "report", "plan"])
def test_every_command_has_help_and_refuses_an_unknown_flag(command, tmp_path):
    proc = run_dtrain([command, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower() or "powered by hydra" in proc.stdout.lower(), proc.stdout
    path = [] if command in ("train", "prepare", "plan") else [str(tmp_path)]  # the commands' RUN_DIR / PATH
    assert_user_error(run_dtrain([command, *path, "--no-such-flag"]), "--no-such-flag")


CHECK_WITHOUT_TORCH = """
import sys
from trainer.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    print("exit", exit.code, "torch loaded" if "torch" in sys.modules else "no torch", file=sys.stderr)
"""


@pytest.mark.parametrize("problem", [
    ["train.max_steps=0"],  # a config error
    ["data.name=absent"],  # a data-path error
    ["parallel.mode=tp"],
])
def test_a_user_error_arrives_before_torch_is_imported(problem, data_dir, tmp_path):
    """The checking layer (cli, compose, config, run-dir checks, data checks) imports no torch, so
    the one line arrives in less time than `import torch` alone takes."""
    args = tiny_args(data_dir, tmp_path / "run", *problem)
    proc = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_TORCH, *args], cwd=REPO, capture_output=True,
                          text=True, env=dtrain_env(), timeout=120)
    assert "error:" in proc.stderr and "exit 2 no torch" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,needle", [
    (["--help"], None),
    (["--device-memory", "lots"], "cannot read memory size 'lots'"),
    (["train.max_steps=0"], "train.max_steps"),
])
def test_plan_reads_its_arguments_and_checks_the_config_before_torch(args, needle):
    """`dtrain plan`'s help and its users' mistakes arrive at once: torch loads for the table only."""
    proc = subprocess.run([sys.executable, "-c", CHECK_WITHOUT_TORCH, "plan", *args], cwd=REPO, capture_output=True,
                          text=True, env=dtrain_env(), timeout=120)
    if needle is None:
        assert "usage: dtrain plan" in proc.stdout and "exit 0 no torch" in proc.stderr, proc.stderr
        return
    assert needle in proc.stderr and "exit 2 no torch" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["train.compile_mode=fast"], "train.compile_mode='fast' is unknown"),
    (["train.compile_mode=reduce-overhead"], "needs train.compile=true"),
    (["train.loss_chunks=0"], "train.loss_chunks=0 must be at least 1"),
    (["train.seq_len=16", "train.loss_chunks=17"], "exceeds train.seq_len=16"),
    (["launch.start_method=fork"], "launch.start_method='fork' is unknown; choose one of forkserver, spawn"),
])
def test_bad_values_are_one_line(args, needle, data_dir, tmp_path):
    proc = run_dtrain(tiny_args(data_dir, tmp_path / "run", *args))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_eval_command_errors(hellaswag_run, tmp_path):
    run_dir = hellaswag_run["run_dir"]
    proc = run_dtrain(["eval", str(tmp_path)])
    assert proc.returncode == 2 and "not a dtrain run directory" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0}\nnot json\n')
    proc = run_dtrain(["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}", f"eval.hellaswag.path={bad}"])
    assert proc.returncode == 2 and "line 2: not valid JSON" in proc.stderr, proc.stderr
    proc = run_dtrain(["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}", "eval.nope=1"])
    assert proc.returncode == 2 and "bad override" in proc.stderr, proc.stderr
