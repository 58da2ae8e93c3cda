"""An optimizer is one registration (issue 46): a throwaway one, registered from outside the package
the way docs/optimizers.md tells a user (its module on PYTHONPATH, its conf/optim/NAME.yaml in a
config folder of the user's, `--config-dir`), passes validation, is counted by the memory check
and the plan, and trains in every parallel mode with parity to one process, its state resharded
by a resume from zero into zero_torch. Nothing in trainer/ names it.

The optimizer is torch.optim.SGD with Nesterov momentum, whose `momentum` and `nesterov` are keys of
its own (`optim.args`), its state one `momentum_buffer` per parameter and no step count.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers.checkpoints import one_process_optimizer
from helpers.dtrain import REPO, dtrain_env, run_dtrain, tiny_args, train_losses
from helpers.runs import ONE_PROCESS, assert_matches_one_process, on_reference_steps

from scripts.benchmarks.memory import optimizer_state_tensors, tensor_bytes
from trainer.config.command_line import ConfigSource
from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.errors import ConfigError, UserError
from trainer.model.gpt import build_model
from trainer.parallel import strategy_class
from trainer.plan.memory import estimate, model_state_floor
from trainer.preflight.torch_checks import check_model_fits, check_with_torch

MODULE = "throwaway_optims.sgd"
SGD_MODULE = '''
import torch

from trainer.optim.registry import Elementwise, State


def sgd_kwargs(optim_cfg, device):
    return dict(lr=optim_cfg.lr, momentum=optim_cfg.args.momentum, nesterov=optim_cfg.args.nesterov)


OPTIMIZER = Elementwise("SGD", torch.optim.SGD, sgd_kwargs, State(tensors=("momentum_buffer",)),
                        step_copies={"cpu": 1, "cuda": 1}, args=("momentum", "nesterov"))
'''
SGD_YAML = f"""name: {MODULE}
lr: 0.05
min_lr: 0.005
args:
  momentum: 0.9
  nesterov: true
"""
STEPS, INTERVAL = 4, 2
# 256-token steps as the parity tests run them (helpers.runs: on_reference_steps' micro batches x world x
# accumulation = 256), a checkpoint every 2 so zero's run is also the resume test's origin
BATCH = ["optim=sgd", "train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={STEPS}",
         f"checkpoint.interval={INTERVAL}"]
CASES = {mode: on_reference_steps(mode) for mode in ("none", "dp", "ddp", "zero", "zero_torch", "fsdp")}


@pytest.fixture(scope="module")
def registration(module_tmp):
    """(the folder on PYTHONPATH holding the module, the user's config folder holding optim/sgd.yaml)."""
    root = module_tmp.mktemp("registered")
    (root / "throwaway_optims").mkdir()
    (root / "throwaway_optims" / "__init__.py").write_text("")
    (root / "throwaway_optims" / "sgd.py").write_text(SGD_MODULE)
    conf = root / "conf"
    (conf / "optim").mkdir(parents=True)
    (conf / "optim" / "sgd.yaml").write_text(SGD_YAML)
    return root, conf


@pytest.fixture
def config(registration, monkeypatch):
    """overrides -> the config `dtrain train --config-dir CONF optim=sgd ...` composes (validated)."""
    root, conf = registration
    monkeypatch.syspath_prepend(str(root))

    def composed(*overrides: str):
        cfg = compose(["model=tiny", "train.device=cpu", "optim=sgd", *overrides],
                      source=ConfigSource(config_dirs=(conf,)))
        validate(cfg)
        return cfg

    return composed


def user_env(root) -> dict[str, str]:
    env = dtrain_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


# --- validation, the memory check, the plan (in process) -------------------------------------------
def test_validation_takes_the_registered_name_and_refuses_what_is_not_one(config):
    cfg = config()
    assert cfg.optim.name == MODULE and cfg.optim.args == {"momentum": 0.9, "nesterov": True}
    for name, fix in ((f"{MODULE}x", "names no module on the Python path"),
                      ("sgd", "must be one of adamw, lion, muon")):
        with pytest.raises(ConfigError, match=re.escape(fix)):
            config(f"optim.name={name}")


def test_the_memory_check_finds_its_registration_and_its_own_keys(config):
    check_with_torch(config(), 1)  # the registration and its optim.args pass
    with pytest.raises(ConfigError, match=r"optim.args.dampening is not a key of .* \(its keys: momentum, nesterov\)"):
        check_with_torch(config("+optim.args.dampening=0.1"), 1)
    with pytest.raises(ConfigError, match=r"optim.name='json.tool': module json.tool defines no OPTIMIZER"):
        check_with_torch(config("optim.name=json.tool"), 1)
    with pytest.raises(UserError) as err:
        check_model_fits(config("model.n_embd=1000000"), 1, torch.device("cpu"))
    assert "fp32 weights, gradients and SGD state (parallel=none" in str(err.value)


def test_the_plan_counts_its_one_state_tensor_as_measured(config):
    """The plan's optimizer state of one process equals what an SGD step leaves (one momentum
    buffer per parameter, no step count), and the sharded modes' floor halves it at world 2."""
    cfg = config()
    model = build_model(cfg.model)
    optimizer = one_process_optimizer(model, cfg)
    assert type(optimizer) is torch.optim.SGD
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.9
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    assert estimate(cfg, "none", 1, 1, "cpu").optim == tensor_bytes(optimizer_state_tensors(optimizer)) == 4 * params
    half = -(-params // 2)  # fp32 weights and gradients, whole or sharded, and one buffer per element
    floors = {"none": 4 * (2 * params + params), "zero": 4 * (2 * params + half), "fsdp": 4 * (2 * half + half)}
    for mode, floor in floors.items():
        assert model_state_floor(cfg, strategy_class(mode), 2) == floor, mode


def test_plan_command_answers_for_it(registration):
    """`dtrain plan` takes no --config-dir; Hydra's hydra.searchpath finds the user's folder."""
    root, conf = registration
    proc = run_dtrain(["plan", f"hydra.searchpath=[file://{conf}]", "model=tiny", "optim=sgd", "parallel=zero",
                       "world=2", "train.micro_batch_size=4"], env=user_env(root))
    assert proc.returncode == 0, proc.stderr
    assert "zero_torch" in proc.stdout and "fsdp" in proc.stdout


# --- every mode (one short run each) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(data_dir, registration, module_tmp):
    """name ("reference" or a mode) -> the run dir of its one uninterrupted run (made once)."""
    root, conf = registration
    made, base = {}, module_tmp.mktemp("sgd_runs")

    def get(name: str):
        if name not in made:
            run_dir = base / name
            args = tiny_args(data_dir, run_dir, *BATCH, *(ONE_PROCESS if name == "reference" else CASES[name]))
            proc = run_dtrain([args[0], "--config-dir", str(conf), *args[1:]], env=user_env(root), check=True)
            made[name] = run_dir, proc.stdout
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(CASES))
def test_every_mode_trains_it_as_one_process_does(mode, runs):
    reference, stdout = runs("reference")
    assert f"optim={MODULE} |" in " ".join(stdout.split())
    assert_matches_one_process(train_losses(reference), train_losses(runs(mode)[0]), STEPS, mode)


@pytest.mark.slow
def test_zero_checkpoint_resumes_under_zero_torch(data_dir, registration, runs, tmp_path):
    """zero's SGD momentum (each rank's rows) loads into zero_torch's whole parameters by name (the
    state templates come from the registration) and continues the trajectory."""
    root, conf = registration
    origin, _ = runs("zero")
    run_dir = tmp_path / "resharded"
    args = tiny_args(data_dir, run_dir, *BATCH, *CASES["zero_torch"],
                     f"resume={origin / 'checkpoints' / f'step_{INTERVAL:06d}'}")
    run_dtrain([args[0], "--config-dir", str(conf), *args[1:]], env=user_env(root), check=True)
    want, got = train_losses(origin), train_losses(run_dir)
    assert sorted(got) == list(range(INTERVAL + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)


def test_nothing_in_trainer_names_it():
    for path in sorted((REPO / "trainer").rglob("*.py")):
        assert "throwaway" not in path.read_text() and "optim.SGD" not in path.read_text(), path
