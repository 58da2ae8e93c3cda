"""Learning-rate schedules (issue 37): optim.schedule=cosine|wsd|linear after the warmup, for AdamW and
Muon alike; a WSD run's stable-phase checkpoint continues bitwise into a longer run; parity across
modes; bad values are one `error:` line."""

from __future__ import annotations

import pytest
from helpers.dtrain import run_dtrain, tiny_args, train_losses
from helpers.errors import assert_user_error
from omegaconf import OmegaConf

from trainer.optim.schedule import lr_at, warmup_notice


def schedule(name: str, **extra) -> OmegaConf:
    return OmegaConf.create({"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "schedule": name,
                             "decay_fraction": 0.2, **extra})


def test_wsd_holds_the_rate_until_the_decay_then_falls_in_a_line_to_min_lr():
    cfg = schedule("wsd")
    assert [lr_at(s, cfg, 100) for s in range(10)] == [1e-3 * (s + 1) / 10 for s in range(10)]  # warmup
    assert all(lr_at(s, cfg, 100) == 1e-3 for s in range(10, 80))  # stable: the last 20% decays
    decay = [lr_at(s, cfg, 100) for s in range(80, 101)]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert max(steps) - min(steps) < 1e-15 and all(d > 0 for d in steps)  # a straight line down
    assert lr_at(100, cfg, 100) == 1e-4
    # the stable phase does not depend on max_steps: a longer run agrees until its own decay
    assert all(lr_at(s, cfg, 100) == lr_at(s, cfg, 1000) for s in range(80))
    assert lr_at(90, schedule("wsd", decay_fraction=1.0), 100) == pytest.approx(1e-3 - 0.9e-3 * 80 / 90)


def test_linear_and_cosine_reach_min_lr_at_max_steps():
    for name in ("linear", "cosine"):
        cfg = schedule(name)
        lrs = [lr_at(s, cfg, 100) for s in range(10, 101)]
        assert lrs[0] == 1e-3 and lrs[-1] == 1e-4 and all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(55, schedule("linear"), 100) == pytest.approx(1e-3 - 0.9e-3 * 0.5)
    assert lr_at(55, OmegaConf.create({"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10}), 100) == \
        lr_at(55, schedule("cosine"), 100)  # cosine stays the default


@pytest.mark.parametrize("override,needle", [
    ("optim.schedule=step", "optim.schedule='step' is unknown; choose one of cosine, wsd, linear"),
    ("optim.decay_fraction=0", "must be in (0, 1]"),
    ("optim.decay_fraction=1.5", "optim.decay_fraction=1.5 must be in (0, 1]"),
    ("optim.decay_fraction=-0.1", "must be in (0, 1]"),
])
def test_bad_schedule_values_are_one_line_and_nothing_is_written(data_dir, tmp_path, override, needle):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "optim.schedule=wsd", override)
                      if "decay" in override else tiny_args(data_dir, run_dir, override))
    assert_user_error(proc, needle)
    assert not run_dir.exists()


def test_a_warmup_that_fills_the_run_is_said_and_the_run_trains(data_dir, tmp_path):
    """A recipe's warmup kept for a short run: the rate never reaches optim.lr nor decays. It trains,
    as asked, with one line saying so (training under 1% of the rate went unsaid, before)."""
    assert warmup_notice(schedule("cosine"), 11) is None  # the warmup ends before the last step
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=3", "optim.warmup_steps=300"), check=True)
    assert ("dtrain: optim.warmup_steps=300 is not below train.max_steps=3: the whole run warms up, its learning "
            "rate reaching 6.00e-06 (1% of optim.lr) at the last step") in " ".join(proc.stderr.split()), proc.stderr
    assert sorted(train_losses(run_dir)) == [1, 2, 3]


# 10 steps: the warmup (2), the stable phase (indices 2-4) and the decay (5-9), each a few steps
WSD = ["optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.warmup_steps=2", "checkpoint.interval=4",
       "train.max_steps=10"]


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_a_stable_phase_checkpoint_continues_bitwise_into_a_longer_run(data_dir, tmp_path, optim):
    """A 10-step WSD run decays from step 5; its step-4 checkpoint is still in the stable phase, so
    `resume=` it with train.max_steps=12 trains exactly as a 12-step WSD run from the start (whose
    decay begins at step index 6)."""
    short, longer, reference = tmp_path / "short", tmp_path / "longer", tmp_path / "reference"
    run_dtrain(tiny_args(data_dir, short, f"optim={optim}", *WSD, "checkpoint.keep=5"), check=True)
    run_dtrain(tiny_args(data_dir, longer, f"optim={optim}", *WSD, "train.max_steps=12",
                         f"resume={short / 'checkpoints' / 'step_000004'}"), check=True)
    run_dtrain(tiny_args(data_dir, reference, f"optim={optim}", *WSD, "train.max_steps=12"), check=True)
    want, got = train_losses(reference), train_losses(longer)
    assert sorted(got) == list(range(5, 13))
    assert got == {s: want[s] for s in got}
    assert train_losses(short)[4] == want[4]  # the short run itself agreed until its decay began
    assert train_losses(short)[8] != want[8]  # its decay (from step index 5) shows from step 7 on


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_wsd_keeps_parity_across_modes(shared_run, mode):
    one, _ = shared_run(*WSD, "parallel=none", "train.micro_batch_size=8")
    other, _ = shared_run(*WSD, f"parallel={mode}", "world=2")
    want, got = train_losses(one), train_losses(other)
    assert sorted(got) == sorted(want) and all(abs(got[s] - want[s]) < 1e-5 for s in want)
