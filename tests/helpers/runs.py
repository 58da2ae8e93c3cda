"""The shared run recipes: the 256-token reference steps every parallel mode must track, the
checkpointed runs the fault tests resume, and their once-per-session cache (conftest.py's
`shared_run` and `references` fixtures hand them out)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from helpers.dtrain import run_dtrain, tiny_args
from helpers.once import made_once

# The one-process run of 256-token steps (tiny model, AdamW, accumulation 4) that test_parity's
# modes must track and test_muon's Muon must leave: made once per session for both.
REFERENCE_STEPS = 16
REFERENCE_BATCH = ["train.total_batch_size=256", "train.seq_len=32", f"train.max_steps={REFERENCE_STEPS}",
                   "optim.lr=1e-3"]
ONE_PROCESS = ["parallel=none", "train.micro_batch_size=2"]  # the reference: accumulation 4
# Muon's runs of the same batches (test_muon, test_compat): decay on, so fsdp's per-shard decay is
# checked too, and a checkpoint every 4 steps, so a parity run is also a resume test's reference.
# Layouts without model parallelism reading REFERENCE_BATCH's 256 tokens per step (x 32 tokens x
# data-parallel ranks x accumulation 1): what a model-parallel checkpoint is resumed under.
PLAIN_LAYOUTS = {
    "fsdp_w2": ["parallel=fsdp", "world=2", "train.micro_batch_size=4"],
    "none": ["parallel=none", "train.micro_batch_size=8"],
}
MUON_BATCH = ["optim=muon", *REFERENCE_BATCH, "optim.muon.weight_decay=0.1", "checkpoint.interval=4"]


class Mode(NamedTuple):
    """How the tests run one parallel mode."""

    launch: tuple[str, ...]  # the mode and its world: every distributed mode at world 2, hsdp's mesh at 4
    # the micro batch on the 256-token reference steps: micro batch x 32 tokens x world x accumulation = 256
    reference_micro_batch: int
    # what its checkpointed reference run (CKPT_ARGS) adds; None: the fault tests do not resume it
    checkpointed: tuple[str, ...] | None


MODES = {
    "none": Mode(("parallel=none",), 8, ()),
    "dp": Mode(("parallel=dp",), 4, None),
    "ddp": Mode(("parallel=ddp", "world=2"), 4, ()),
    "zero": Mode(("parallel=zero", "world=2"), 2, ("checkpoint.async_save=true",)),
    # torch's ZeroRedundancyOptimizer: each rank saves the whole parameters it owns, by name
    "zero_torch": Mode(("parallel=zero_torch", "world=2"), 2, ()),
    "fsdp": Mode(("parallel=fsdp", "world=2"), 2, ()),
    # FSDP2 on a 2 x 2 mesh (two replicas of two shards): world 4, accumulation 2
    "hsdp": Mode(("parallel=hsdp", "parallel.dp_replicate=2", "world=4"), 1, None),
}
RESUMED_MODES = [name for name, mode in MODES.items() if mode.checkpointed is not None]


def on_reference_steps(mode: str) -> list[str]:
    """A mode's overrides on the 256-token reference steps, as test_parity, test_muon and test_compat
    run them."""
    return [*MODES[mode].launch, f"train.micro_batch_size={MODES[mode].reference_micro_batch}"]


def checkpointed(mode: str) -> list[str]:
    """A mode's overrides on top of CKPT_ARGS, as the fault tests run and resume it."""
    assert MODES[mode].checkpointed is not None, f"the fault tests do not resume {mode}"
    return [*MODES[mode].launch, *MODES[mode].checkpointed]


def assert_matches_one_process(want: dict[int, float], got: dict[int, float], steps: int, case: str) -> None:
    """Every step logged, each loss within 1e-5 of the single-process reference's."""
    assert sorted(got) == list(range(1, steps + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < 1e-5, f"{case}: max |loss - single| = {worst:.3g}"


# The checkpointed runs the fault tests (test_checkpoint, test_checkpoint_verify, test_continuation,
# test_elastic, test_multinode, test_train_e2e) resume or compare with.
STEPS, INTERVAL = 8, 3
# Accumulation on, a checkpoint every 3 steps and at the end; the global batch is
# 4 x 64 x world x accum tokens.
CKPT_ARGS = (f"train.max_steps={STEPS}", f"checkpoint.interval={INTERVAL}", "train.grad_accum_steps=2")
CKPT_NAMES = ["step_000003", "step_000006", "step_000008"]  # keep=3, the default


def reference_run(mode: str, data_dir: Path, root: Path) -> Path:
    """An uninterrupted run, made once per session in `root` (conftest.py's `references` hands it
    out; helpers.once lets every worker share it)."""
    return made_once(root / f"reference_{mode}",
                     lambda run_dir: run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *checkpointed(mode)),
                                                check=True))


RESUMED = ("train.max_steps=9",)  # the copied run (8 steps) continues to step 9
