"""The compatibility tier (`make test-compat`: `pytest -m compat` in .venv-compat, on the oldest torch
dtrain supports; CI runs it there, and the full suite runs it on the pinned torch too).

What a user of an older torch does first: every parallel mode with AdamW and with Muon (world 2
where the mode has workers) tracks one process within 1e-5, a sharded run killed with kill -9
continues bitwise under the same command, `dtrain export` writes weights that give the run's
logits, and `dtrain plan` prints every mode. A short version of what the pinned torch's suite checks
at length: a torch API missing or changed on the floor fails here.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import assert_continues_bitwise
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import (
    MODES,
    MUON_BATCH,
    ONE_PROCESS,
    REFERENCE_BATCH,
    REFERENCE_STEPS,
    assert_matches_one_process,
    on_reference_steps,
)

from trainer.huggingface.mapping import CONV1D_WEIGHTS
from trainer.weights.from_checkpoint import model_from_run

pytestmark = pytest.mark.compat

STEPS = REFERENCE_STEPS
# optimizer -> the settings of its runs: 256-token steps, and for Muon a checkpoint every 4 steps
# (kill -9 lands between them). The same runs as test_parity's and test_muon's, shared with them
# (conftest.shared_run) when the whole suite runs; the compat tier alone makes its own.
OPTIMIZERS = {"adamw": REFERENCE_BATCH, "muon": MUON_BATCH}
CP_VALIDATED = "train.val_interval=8"  # test_context_parallel.VALIDATED


@pytest.fixture(scope="module")
def runs(shared_run):
    """(mode or "reference", optimizer) -> the run dir of the session's uninterrupted run."""
    return lambda mode, optim: shared_run(*OPTIMIZERS[optim], *(ONE_PROCESS if mode == "reference"
                                                                else on_reference_steps(mode)))[0]


@pytest.mark.slow
@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_and_optimizer_matches_one_process(mode, optim, runs):
    reference = train_losses(runs("reference", optim))
    assert reference[STEPS] < reference[1], reference  # it learns
    case = f"{mode} {optim} on torch {torch.__version__}"
    assert_matches_one_process(reference, train_losses(runs(mode, optim)), STEPS, case)


@pytest.mark.slow
def test_sharded_kill_9_then_the_same_command_is_bitwise(data_dir, runs, tmp_path):
    """fsdp with Muon (DTensor shards, DCP, the owners' gathered matrices): kill -9 of the driver
    and its workers past a checkpoint, then the same command continues bit for bit."""
    reference = runs("fsdp", "muon")
    run_dir, log = tmp_path / "run", tmp_path / "killed.log"
    args = tiny_args(data_dir, run_dir, *MUON_BATCH, *on_reference_steps("fsdp"))
    assert kill_past_a_checkpoint(args, run_dir, log) < STEPS
    assert_continues_bitwise(args, run_dir, reference)


@pytest.mark.slow
def test_context_and_tensor_parallelism_match_one_process(runs, shared_run):
    """parallel.cp and parallel.tp under fsdp on the floor torch: the differentiable all-gather of
    keys and values, the bottom-right causal mask and the flattened dp_shard x cp mesh
    (trainer/parallel/context_parallel.py), and the DTensor shards of the tensor-parallel plan."""
    reference = train_losses(runs("reference", "adamw"))
    # the context-parallel run is test_context_parallel's fsdp_cp2 run, argument for argument (its
    # validation at step 8 too): the whole suite trains it once (conftest.shared_run)
    for layout in ([CP_VALIDATED, "parallel=fsdp", "parallel.cp=2", "world=2"],
                   ["parallel=fsdp", "parallel.tp=2", "world=2"]):
        got = train_losses(shared_run(*REFERENCE_BATCH, *layout, "train.micro_batch_size=2")[0])
        assert_matches_one_process(reference, got, STEPS, f"{' '.join(layout)} on torch {torch.__version__}")


@pytest.mark.slow
def test_export_of_a_sharded_run_gives_its_logits(runs, tmp_path):
    from safetensors.torch import load_file  # the export extra: .venv-compat installs it

    run_dir = runs("fsdp", "adamw")
    out = tmp_path / "hf"
    run_dtrain(["export", str(run_dir), "--out", str(out)], check=True)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    model, _ = model_from_run(run_dir)
    model.eval()
    # Hugging Face's GPT-2 layout back into ours: Conv1D weights transposed, the padded rows of
    # the vocabulary (zeros) appended, the head tied to the embedding.
    state = {}
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        tensor = tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor
        if name == "transformer.wte.weight":
            padded = model.transformer.wte.weight.shape[0]
            tensor = torch.cat([tensor, torch.zeros(padded - tensor.shape[0], tensor.shape[1])])
        state[name] = tensor
    state["lm_head.weight"] = state["transformer.wte.weight"]
    exported, _ = model_from_run(run_dir)
    exported.load_state_dict(state)
    idx = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported.eval()(idx)[0], model(idx)[0])


def test_plan_prints_every_mode_for_muon():
    proc = run_dtrain(["plan", "model=tiny", "optim=muon", "parallel=fsdp", "world=2", "train.micro_batch_size=4",
                       "--device-memory", "8GiB"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│")]
    assert rows == list(MODES), proc.stdout
    assert "max micro batch" in proc.stdout and "8.00 GiB" in proc.stdout
