"""Issue 13, validation: every bad value, option, folder or disk is refused before anything runs,
as one `error:` line naming the fix, exit code 2, no traceback and no run directory."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from helpers.dtrain import REPO, args_with, dtrain_env, run_dtrain
from helpers.errors import assert_nothing_written, assert_user_error
from omegaconf import OmegaConf

from trainer.config.compose import compose
from trainer.config.schema import GROUP_SCHEMAS, Config, to_dict
from trainer.config.validation import RANGES, check_ranges, validate
from trainer.config.vocab import TOKENIZER_VOCAB_SIZE
from trainer.errors import ConfigError, UserError
from trainer.io import write_errors_as_user_errors
from trainer.model.gpt import build_model
from trainer.parallel import STRATEGIES, make_strategy
from trainer.preflight.rundir import write_config_record
from trainer.process.runtime import Runtime
from trainer.tokenizers.gpt2 import VOCAB_SIZE


@pytest.fixture(scope="module")
def data_dir(gpt2_data_dir):
    """The session corpus in GPT-2's vocabulary for this module: its vocabulary checks name GPT-2's
    tokenizer."""
    return gpt2_data_dir


@pytest.mark.parametrize(
    "overrides,needles",
    [
        # an optional config group used to ignore an unknown option (the defaults trained, exit 0)
        (["experiment=nonexistent"],
         ["experiment/nonexistent", "available: debug, finetune_shakespeare, gpt2_124m_fineweb"]),
        (["hparams_search=typo"], ["hparams_search/typo", "available: optuna_lr"]),
        (["optim.eps=-1"], ["optim.eps=-1.0 must be positive", "optim.eps=1e-08"]),
        (["model.dropout=1.5"], ["model.dropout=1.5 must be in [0, 1)", "model.dropout=0.0"]),
        (["model.vocab_size=100"], ["smaller than the GPT-2 tokenizer's 50257", "set model.vocab_size=50257"]),
        (["optim.warmup_steps=-1"], ["optim.warmup_steps=-1 must be at least 0"]),
        (["optim.grad_clip=-1"], ["optim.grad_clip=-1.0 must be at least 0"]),
        (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1 must be at least 0"]),
        (["optim.lr=-1"], ["optim.lr=-1.0 must be positive"]),
        (["train.val_interval=-1"], ["train.val_interval=-1 must be at least 0"]),
        (["train.val_batches=-1"], ["train.val_batches=-1 must be at least 0"]),
        (["train.val_tokens=-1"], ["train.val_tokens=-1 must be at least 0", "train.val_tokens=8192"]),
        (["train.val_tokens=50"], ["train.val_tokens=50 is less than one sequence of train.seq_len=64",
                                   "set train.val_tokens=64 or more (or 0 for no validation)"]),
        (["train.sample_tokens=-1"], ["train.sample_tokens=-1 must be at least 0"]),
        (["train.seed=-1"], ["train.seed=-1 must be at least 0"]),
        (["train.total_batch_size=0"], ["train.total_batch_size=0 must be at least 1 (or null: derived)"]),
        (["launch.threads_per_worker=-2"], ["launch.threads_per_worker=-2 must be at least 1 (or null"]),
        (["launch.timeout_s=0"], ["launch.timeout_s=0 must be at least 1", "launch.timeout_s=300"]),
        (["launch.rdzv_timeout=0"], ["launch.rdzv_timeout=0 must be at least 1"]),
        (["launch.max_restarts=-1"], ["launch.max_restarts=-1 must be at least 0"]),
        (["launch.monitor_interval=0"], ["launch.monitor_interval=0.0 must be positive"]),
        (["parallel.bucket_cap_mb=0"], ["parallel.bucket_cap_mb=0.0 must be positive"]),
        (["parallel.mixed_precision=fp16"], ["parallel.mixed_precision='fp16' must be one of auto, bf16, fp32"]),
        (["data.shard_tokens=0"], ["data.shard_tokens=0 must be at least 1"]),
        (["eval.limit=0"], ["eval.limit=0 must be at least 1 (or null: every example)"]),
        (["eval.hellaswag.batch_examples=0"], ["eval.hellaswag.batch_examples=0 must be at least 1"]),
        (["checkpoint.keep=0"], ["checkpoint.keep=0 must be at least 1"]),
        (["checkpoint.interval=-1"], ["checkpoint.interval=-1 must be at least 0"]),
        (["model.n_head=0"], ["model.n_head=0 must be at least 1"]),  # was a ZeroDivisionError
        (["parallel.tp=0"], ["parallel.tp=0 must be at least 1", "parallel.tp=1"]),  # was a ZeroDivisionError too
        (["model=llama_tiny", "model.n_kv_head=3"], ["model.n_kv_head=3 must divide model.n_head=4"]),
        (["model.pos=rope", "model.n_head=8", "model.n_embd=24"], ["model.pos=rope rotates pairs", "an odd number"]),
        (["world=0"], ["world=0 must be at least 1"]),
        # two replicas that never synchronise would train two unrelated models
        (["parallel=none", "world=2"], ["parallel=none does not synchronise gradients", "use parallel=ddp"]),
        # the count the user gave, not the replicas it makes (it said world=2 for world=4, before)
        (["model=llama_tiny", "parallel=none", "parallel.tp=2", "world=4"],
         ["so world=4 over groups of 2 (parallel.cp x parallel.tp) would train 2 unrelated copies",
          "use world=2 for one model over those ranks, or parallel=fsdp for 2 synchronised copies"]),
        # Hydra's override lexer refuses unquoted non-ASCII characters with a bare lexer error
        (["data.dir=/tmp/日本"], ["has non-ASCII characters", "quote the value: 'data.dir=\"/tmp/日本\"'"]),
    ],
)
def test_bad_value_is_one_line_and_writes_nothing(overrides, needles, data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(args_with(data_dir, run_dir, *overrides))
    assert_user_error(proc, *needles)
    assert_nothing_written(run_dir)


def test_unquoted_non_ascii_run_dir_is_refused_and_quoted_works(data_dir, tmp_path):
    run_dir = tmp_path / "ü" / "run"
    proc = run_dtrain(args_with(data_dir, run_dir, f"hydra.run.dir={run_dir}"))
    assert_user_error(proc, "has non-ASCII characters", f"'hydra.run.dir=\"{run_dir}\"'")
    assert not run_dir.parent.exists()
    # the quoted form Hydra accepts, as the message says (composed only: no run needed)
    cfg = compose([f'hydra.run.dir="{run_dir}"', 'data.dir="/tmp/日本"'], return_hydra_config=True)
    assert cfg.hydra.run.dir == str(run_dir) and cfg.data.dir == "/tmp/日本"


def test_sweep_with_a_non_ascii_value_gets_the_same_hint(data_dir, tmp_path):
    proc = run_dtrain(["train", "-m", "optim.lr=1e-3,2e-3", "data.dir=/tmp/ü", f"hydra.sweep.dir={tmp_path / 's'}"])
    assert_user_error(proc, "quote the value")
    assert not (tmp_path / "s").exists()


def test_experiment_groups_still_compose():
    assert compose([]).model.name == "cpu_small"  # no experiment= at all: the defaults
    assert compose(["experiment=debug"]).train.max_steps == 6


def test_every_range_holds_for_the_defaults():
    """Every key of RANGES exists and the composed defaults pass (so the `e.g.` values work)."""
    cfg = compose([])
    check_ranges(cfg)
    for key in RANGES:
        assert OmegaConf.select(cfg, key, default="absent") != "absent", key
    assert TOKENIZER_VOCAB_SIZE == VOCAB_SIZE  # config/vocab.py's torch-free copy matches tokenizers/gpt2.py's


def test_check_world_refuses_unsynced_training_but_not_eval():
    rt = Runtime(rank=0, local_rank=0, world=2, local_world=2, device=torch.device("cpu"), distributed=False)
    cfg = compose(["model=tiny", "parallel=none"])
    with pytest.raises(ConfigError, match="does not synchronise gradients"):
        make_strategy(cfg.parallel, cfg.train, rt)
    assert make_strategy(cfg.parallel, cfg.train, rt, training=False).name == "none"
    for cls in STRATEGIES.values():  # every mode that syncs replicas trains at world 2
        if cls.syncs_replicas:
            cls.check_world(2)


@pytest.mark.slow
def test_eval_still_runs_parallel_none_at_world_two(tmp_path):
    """`dtrain eval` scores its share on each worker with a full replica: world 2, parallel=none."""
    run_dir = tmp_path / "run"
    cfg = compose(["model=tiny", "train.device=cpu"])
    write_config_record(run_dir, to_dict(cfg))
    torch.manual_seed(0)
    torch.save(build_model(cfg.model).state_dict(), run_dir / "model.pt")
    examples = tmp_path / "hs.jsonl"
    examples.write_text("".join(json.dumps({"ctx": f"The {w} sat", "endings": ["down.", "up.", "on it.", "still."],
                                            "label": 0}) + "\n" for w in ("cat", "dog", "king", "queen")))
    proc = run_dtrain(["eval", str(run_dir), f"ckpt={run_dir / 'model.pt'}", f"eval.hellaswag.path={examples}",
                       "parallel=none", "world=2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((run_dir / "eval_hellaswag.json").read_text())
    assert (result["world"], result["parallel"], result["hellaswag_n"]) == (2, "none", 4)


def test_eval_override_out_of_range_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    write_config_record(run_dir, to_dict(compose(["model=tiny"])))
    proc = run_dtrain(["eval", str(run_dir), "eval.limit=-1"])
    assert_user_error(proc, "eval.limit=-1 must be at least 1")


def test_prepare_refuses_a_shard_size_of_zero(tmp_path):
    proc = run_dtrain(["prepare", "data=text", "data.name=x", f"data.source={tmp_path / 'x.txt'}",
                       f"data.dir={tmp_path / 'data'}", "data.shard_tokens=0"])
    assert_user_error(proc, "data.shard_tokens=0 must be at least 1")
    assert not (tmp_path / "data").exists()


# --- folders and disks ----------------------------------------------------------------------------
def _chattr(path: Path, on: bool) -> bool:
    if not shutil.which("chattr"):
        return False
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(folder: Path) -> None:
    """Write into folder until the file system has no block left."""
    try:
        with open(folder / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as err:  # the close flushes too, and fails the same way
        assert err.errno == errno.ENOSPC, err


def test_run_dir_under_a_file_is_refused(data_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder\n")
    proc = run_dtrain(args_with(data_dir, blocker / "run"))
    assert_user_error(proc, f"{blocker} is a file, not a folder", "choose another hydra.run.dir=")
    assert blocker.read_text() == "not a folder\n"


def test_run_dir_in_an_immutable_folder_is_refused(data_dir, tmp_path):
    """Tests run as root, whom plain permissions do not stop: an immutable folder (chattr +i) does."""
    parent = tmp_path / "frozen"
    parent.mkdir()
    if not _chattr(parent, True):
        pytest.skip("chattr +i is not available on this file system")
    try:
        proc = run_dtrain(args_with(data_dir, parent / "run"))
        assert_user_error(proc, f"the folder {parent} cannot be written", "choose another hydra.run.dir=")
        assert list(parent.iterdir()) == []
    finally:
        _chattr(parent, False)


def test_run_dir_on_a_full_disk_is_refused(data_dir, tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN) to fill a disk")
    try:
        _fill(disk)
        proc = run_dtrain(args_with(data_dir, disk / "run"))
        assert_user_error(proc, f"the disk holding {disk} is full", "free space there or choose another hydra.run.dir=")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


ENOSPC_IN_HYDRA = """
import sys
from pathlib import Path
from trainer.cli import fail
from trainer.config.command_line import ConfigSource
from trainer.config.compose import compose, run_as_hydra_job
from trainer.errors import UserError
from trainer.io import write_errors_as_user_errors

run_dir = Path(sys.argv[1])
cfg = compose([f"hydra.run.dir={run_dir}", "hydra.mode=RUN"], return_hydra_config=True)
try:
    # what trainer/commands/train.py's _single_run does around Hydra's job runner
    with write_errors_as_user_errors(run_dir, "choose another hydra.run.dir="):
        returned = run_as_hydra_job(cfg, ConfigSource(), lambda job_cfg: 0.0)
except UserError as err:
    fail(str(err))
print("wrote", returned)
"""


def test_disk_filling_up_while_hydra_writes_its_config(tmp_path):
    """The disk is full by the time Hydra writes .hydra/config.yaml (after the pre-flight check):
    one line naming the full disk, and the half-made run directory removed again."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN) to fill a disk")
    try:
        _fill(disk)
        run_dir = disk / "outputs" / "run"
        proc = subprocess.run([sys.executable, "-c", ENOSPC_IN_HYDRA, str(run_dir)], cwd=REPO, capture_output=True,
                              text=True, env=dtrain_env(), timeout=120)
        assert_user_error(proc, f"no space left on the disk holding {run_dir}", "free space there")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # outputs/run/.hydra removed again
        (disk / "filler").unlink()  # with room again the same code writes Hydra's record
        proc = subprocess.run([sys.executable, "-c", ENOSPC_IN_HYDRA, str(run_dir)], cwd=REPO, capture_output=True,
                              text=True, env=dtrain_env(), timeout=120)
        assert proc.returncode == 0 and "wrote 0.0" in proc.stdout, proc.stderr
        assert (run_dir / ".hydra" / "config.yaml").is_file()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_write_errors_as_user_errors_leaves_other_errors_alone(tmp_path):
    with pytest.raises(FileNotFoundError):
        with write_errors_as_user_errors(tmp_path / "x", "fix"):
            open(tmp_path / "missing" / "file")
    with pytest.raises(UserError, match="cannot write into"):
        with write_errors_as_user_errors(tmp_path / "x", "fix"):
            raise PermissionError(13, "Permission denied", str(tmp_path / "x"))


@pytest.mark.parametrize(("override", "needle"), [
    ("model.norm=batchnorm", "model.norm='batchnorm' is unknown; choose one of layernorm, rmsnorm"),
    ("model.pos=alibi", "model.pos='alibi' is unknown; choose one of learned, rope"),
    ("model.mlp=geglu", "model.mlp='geglu' is unknown; choose one of gelu, swiglu, relu2"),
    ("model.norm_eps=0", "model.norm_eps=0.0 must be positive"),
    ("model.rope_theta=-1", "model.rope_theta=-1.0 must be positive"),
    ("model.mlp_hidden=0", "model.mlp_hidden=0 must be at least 1 (or null: 4 x n_embd, or Llama's rule"),
    ("model.n_kv_head=0", "model.n_kv_head=0 must be at least 1 (or null: n_head)"),
    ("model.head_dim=0", "model.head_dim=0 must be at least 1 (or null: n_embd / n_head)"),
    ("model.head_dim=15", "each head has model.head_dim=15, an odd number; choose an even model.head_dim"),
])
def test_block_options_are_checked(override, needle):
    with pytest.raises(ConfigError, match=None) as err:
        validate(compose(["model=llama_tiny", override]))
    assert needle in str(err.value)


@pytest.mark.parametrize(("overrides", "needle"), [
    (["parallel.cp=0"], "parallel.cp=0 must be at least 1; e.g. parallel.cp=1"),
    # a limit shorter than a step named every healthy run's first step a hang
    (["launch.hang_timeout_s=0.001"], "launch.hang_timeout_s=0.001 must be 0 (no hang watch) or at least 1 (seconds)"),
    (["parallel.ep=-1"], "parallel.ep=-1 must be at least 1; e.g. parallel.ep=1"),
    (["parallel=hsdp", "parallel.dp_replicate=0"], "parallel.dp_replicate=0 must be at least 1"),
    # a negative weight rewards the routers for unbalanced routing: trained without a word, before
    (["model=qwen3_moe_tiny", "model.moe.aux_loss_coef=-0.01"], "model.moe.aux_loss_coef=-0.01 is negative"),
    # no layer would be MoE: a dense model trained under a MoE preset's name, before
    (["model=qwen3_moe_tiny", "model.moe.every=3"], "model.moe.every=3 makes no layer of model.n_layer=2 a mixture"),
])
def test_mesh_and_expert_values_are_checked(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert needle in str(err.value)


def _numeric_keys(cls, prefix: str = ""):
    """The dotted names of a schema dataclass's int and float fields (optional ones and lists of them too)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kinds = [a for a in typing.get_args(hints[field.name]) if a is not type(None)] or [hints[field.name]]
        if dataclasses.is_dataclass(kinds[0]):
            yield from _numeric_keys(kinds[0], f"{prefix}{field.name}.")
        elif kinds[0] in (int, float):
            yield prefix + field.name


# Numeric keys a check other than RANGES bounds, and where: with RANGES, every number a user can set.
BOUNDED_ELSEWHERE = {
    "model.vocab_size": "validation.check_ranges: at least the tokenizer's ids",
    "model.moe.num_experts": "model_checks.check_moe", "model.moe.top_k": "model_checks.check_moe",
    "model.moe.num_shared_experts": "model_checks.check_moe", "model.moe.expert_hidden": "model_checks.check_moe",
    "model.moe.every": "model_checks.check_moe", "model.moe.aux_loss_coef": "model_checks.check_moe",
    "optim.betas": "validation: two numbers in [0, 1)", "optim.min_lr": "validation: in [0, optim.lr]",
    "tokenizer.vocab_size": "commands/tokenizer.py: dtrain tokenizer train's bounds (training ignores it)",
    "data.tokenizer.vocab_size": "the same key inside a data preset",
    "train.eval_interval": "keys.py: the old name of train.val_interval",
    "train.eval_batches": "keys.py: the old name of train.val_batches",
    "eval.interval": "keys.py: the old name of eval.hellaswag.interval",
}


def test_every_numeric_key_is_bounded():
    """A number a user can set is range-checked (RANGES) or bounded by a named check: parallel.tp=0 was
    a ZeroDivisionError and model.moe.aux_loss_coef=-1 trained, before either was."""
    keys = set(_numeric_keys(Config))
    for section, schema in GROUP_SCHEMAS.items():
        keys |= {f"{section}.{key}" for key in _numeric_keys(schema)}
    assert not keys - set(RANGES) - set(BOUNDED_ELSEWHERE), "give these a range in RANGES or a check"
    assert not set(BOUNDED_ELSEWHERE) & set(RANGES)
    assert set(BOUNDED_ELSEWHERE) <= keys  # no stale entries


def test_head_dim_frees_the_width_from_the_heads():
    """With model.head_dim set, n_head need not divide n_embd (Qwen3: 32 heads of 128 on 2048)."""
    validate(compose(["model=llama_tiny", "model.n_head=3", "model.n_kv_head=1", "model.head_dim=16"]))
    with pytest.raises(ConfigError, match="model.n_embd=64 is not divisible by model.n_head=3; .*model.head_dim"):
        validate(compose(["model=llama_tiny", "model.n_head=3", "model.n_kv_head=1"]))


def test_every_model_preset_is_valid_and_builds_on_meta():
    for preset in sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml")):
        cfg = compose([f"model={preset}"])
        validate(cfg)
        with torch.device("meta"):
            assert build_model(cfg.model).num_params() > 0
