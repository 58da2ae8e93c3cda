"""Time to target (train.target_val_loss, trainer/fit/target.py): the first evaluation at or below the
target records the summary's `target` record and ends the run (finished: the same command again
has nothing to do); training seconds leave out evaluation, measured against a slow evaluation made
for real; a target never met says so; bad values are one error line before anything is written."""

from __future__ import annotations

import math

import pytest
from helpers.dtrain import read_metrics, run_dtrain, tiny_args

from trainer.config.compose import compose
from trainer.config.schema import TrainConfig
from trainer.config.validation import check_ranges
from trainer.errors import ConfigError
from trainer.fit.target import TargetWatch, describe_target

SEQ_LEN = 64
TOKENS_PER_STEP = 4 * SEQ_LEN  # tiny_args: micro batch 4 x seq 64, one process, no accumulation


def end_record(run_dir) -> dict:
    return [r for r in read_metrics(run_dir) if "summary" in r][-1]


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_target_is_one_error_line_before_anything_is_written(data_dir, tmp_path, value):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, f"train.target_val_loss={value}"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: train.target_val_loss=")
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["0", "-0.5", "inf", "nan"])
def test_the_checks_refuse_every_target_no_loss_can_meet(value):
    with pytest.raises(ConfigError, match=r"^train\.target_val_loss="):
        check_ranges(compose([f"train.target_val_loss={value}"]))
    check_ranges(compose(["train.target_val_loss=4.5", "train.continue_after_target=true"]))


def test_a_bad_target_in_a_sweep_is_refused_before_the_sweep_folder(data_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = tiny_args(data_dir, tmp_path / "unused", "train.target_val_loss=4.0,-2", f"hydra.sweep.dir={sweep_dir}")
    proc = run_dtrain([args[0], "-m", *args[1:]])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: train.target_val_loss=-2.0 must be a positive loss in "
                                                "nats (e.g. 4.5) (or null: no target)"]
    assert not sweep_dir.exists()


class _State:
    """The TrainState fields the watch reads (trainer.fit.run.TrainState, without torch's import)."""

    def __init__(self, step, tokens, train_s=2.0):
        self.step, self.tokens, self.train_s = step, tokens, train_s
        self.excluded_s, self.target, self.best_val_loss = {"evaluation": 1.5}, None, 5.0


def test_the_watch_records_the_first_evaluation_at_or_below_once():
    train = TrainConfig(target_val_loss=4.0)
    watch = TargetWatch(train, flops_per_token=1000.0)
    state = _State(step=10, tokens=2560)
    assert not watch.reached({"val_loss": 4.0001}, state) and state.target is None
    assert watch.reached({"val_loss": 4.0}, state)  # at the target counts
    assert state.target == {"reached": True, "target_val_loss": 4.0, "val_loss": 4.0, "step": 10, "tokens": 2560,
                            "train_s": 2.0, "excluded_s": {"evaluation": 1.5}, "flops": 2560 * 1000.0}
    state.step = 12
    assert not watch.reached({"val_loss": 3.0}, state) and state.target["step"] == 10  # recorded once
    assert not watch.reached({"val_loss": math.nan}, _State(1, 1))  # nan is never at or below
    going_on = TargetWatch(TrainConfig(target_val_loss=4.0, continue_after_target=True), 1.0)
    assert not going_on.reached({"val_loss": 3.9}, s := _State(3, 3)) and s.target["reached"]
    unmet = _State(20, 5120)
    assert watch.record(unmet) == {"reached": False, "target_val_loss": 4.0, "best_val_loss": 5.0, "step": 20}
    assert "not reached" in describe_target(watch.record(unmet))
    assert TargetWatch(TrainConfig(), 1.0).record(unmet) is None


@pytest.mark.slow
def test_target_stops_the_run_at_the_first_evaluation_at_or_below_it(data_dir, tmp_path, shared_run):
    reference, _ = shared_run("train.max_steps=12", "train.val_interval=2")
    vals = val_losses(reference)
    assert sorted(vals) == [2, 4, 6, 8, 10, 12]
    # the first evaluation that beats every earlier one, from step 4 on; the target halfway between
    stop = next(s for s in sorted(vals) if s >= 4 and vals[s] < min(v for k, v in vals.items() if k < s))
    target = (vals[stop] + min(v for k, v in vals.items() if k < stop)) / 2

    run_dir = tmp_path / "run"
    args = tiny_args(data_dir, run_dir, "train.max_steps=12", "train.val_interval=2",
                     f"train.target_val_loss={target}")
    proc = run_dtrain(args, check=True)
    assert f"<= {target} at step {stop}" in proc.stdout  # the time-to-target line
    end = end_record(run_dir)
    assert end["step"] == end["summary"]["steps"] == stop
    assert val_losses(run_dir) == {s: v for s, v in vals.items() if s <= stop}  # the same run, cut there
    got = end["target"]
    assert got["reached"] and got["step"] == stop and got["tokens"] == stop * TOKENS_PER_STEP
    assert got["val_loss"] <= target < min(v for k, v in vals.items() if k < stop)
    assert got["target_val_loss"] == target
    flops_per_token = got["flops"] / got["tokens"]
    # 6 x (the tiny model's weights that multiply) plus attention: the model's own count
    assert flops_per_token > 6 * 1000 and float(flops_per_token).is_integer()
    assert set(got["excluded_s"]) >= {"warmup", "evaluation"} and 0 < got["train_s"] <= end["summary"]["train_s"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{stop:06d}"]

    again = run_dtrain(args, check=True)  # finished where the target was met: nothing to do
    assert "already finished" in again.stdout + again.stderr
    assert end_record(run_dir) == end


@pytest.mark.slow
def test_training_seconds_leave_out_a_slow_evaluation(data_dir, tmp_path):
    # 16,384 validation tokens (64 batches) after every step: evaluating takes many times longer than
    # training, so a training step a busy machine holds up for 0.2 s (seen in a CI rehearsal, with
    # 4,096 tokens) does not make it the larger part
    run_dir = tmp_path / "run"
    run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=5", "train.val_interval=1", "train.val_tokens=16384",
                         # the session's 512-id vocabulary starts near ln 512 = 6.24: never met at step 1
                         "train.target_val_loss=6.20", "train.continue_after_target=true"), check=True)
    end = end_record(run_dir)
    summary, excluded = end["summary"], end["excluded_s"]
    wall, train_s = summary["wall_s"], summary["train_s"]
    # evaluation the larger part, whatever the first step (warm-up) took (37x measured: 1.26 s and 0.034 s)
    assert excluded["evaluation"] > 3 * train_s, (excluded, train_s)
    assert train_s < 0.4 * wall, (train_s, wall)
    # every second of the loop is training or one of the excluded kinds
    assert abs(train_s + sum(excluded.values()) - wall) < 0.05 * wall, (train_s, excluded, wall)
    target = end["target"]  # met on the way, the run went on (train.continue_after_target)
    assert target["reached"] and 2 <= target["step"] < 5 and end["step"] == 5
    assert target["train_s"] < train_s and target["excluded_s"]["evaluation"] > target["train_s"]
    # the evaluations' own steps: as many as evaluated up to the target
    assert sum(1 for s in val_losses(run_dir) if s <= target["step"]) == target["step"]


@pytest.mark.slow
def test_a_target_never_met_says_so(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.max_steps=4", "train.val_interval=2",
                                "train.target_val_loss=1.5"), check=True)
    end = end_record(run_dir)
    assert end["step"] == 4
    assert end["target"] == {"reached": False, "target_val_loss": 1.5, "step": 4,
                             "best_val_loss": end["summary"]["best_val_loss"]}
    assert "not reached in 4 steps" in proc.stdout


@pytest.mark.slow
def test_a_continued_run_adds_to_the_training_seconds_of_its_checkpoint(data_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_dtrain(tiny_args(data_dir, first, "train.max_steps=4", "train.val_interval=2", "checkpoint.interval=2",
                         "train.target_val_loss=1.5"), check=True)
    before = end_record(first)
    assert not before["target"]["reached"]
    # continued to 8 steps with a target its first evaluation meets: the seconds are both sessions'
    run_dtrain(tiny_args(data_dir, second, "train.max_steps=8", "train.val_interval=2", "train.target_val_loss=11",
                         f"resume={first / 'checkpoints' / 'step_000004'}"), check=True)
    after = end_record(second)
    target = after["target"]
    assert target["reached"] and target["step"] == after["step"] == 6
    assert target["train_s"] > before["summary"]["train_s"]
    assert target["excluded_s"]["warmup"] > before["excluded_s"]["warmup"]  # each session's first step
    assert target["excluded_s"]["evaluation"] > before["excluded_s"]["evaluation"]


def test_a_bits_per_byte_target_is_watched_the_same_way():
    watch = TargetWatch(TrainConfig(target_val_bpb=2.5), flops_per_token=10.0)
    state = _State(step=4, tokens=1024)
    assert watch.figure == "val_bpb" and not watch.reached({"val_bpb": 2.6}, state)
    assert watch.reached({"val_bpb": 2.5}, state)
    assert state.target["target_val_bpb"] == 2.5 and state.target["val_bpb"] == 2.5
    assert describe_target(state.target).startswith("val bpb 2.5000 <= 2.5 at step 4")
    assert describe_target(TargetWatch(TrainConfig(target_val_bpb=1.0), 1.0).record(_State(9, 9))) == \
        "val bpb 1.0 not reached in 9 steps"


def test_two_targets_at_once_are_one_error_line(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(tiny_args(data_dir, run_dir, "train.target_val_loss=4", "train.target_val_bpb=2"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: train.target_val_loss=4.0 and train.target_val_bpb=2.0: a run stops at one target; set one of them "
        "(the other null)"], proc.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_bits_per_byte_target_stops_the_run(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    # 5 lies between the two figures at the first validation (val bpb ~4.4, val loss ~6.1), so a loop
    # that watched the loss instead of the bits per byte would run on past step 5 and fail this
    args = tiny_args(data_dir, run_dir, "train.max_steps=30", "train.target_val_bpb=5")
    args[args.index("train.val_interval=0")] = "train.val_interval=5"
    run_dtrain(args, check=True)
    target = end_record(run_dir)["target"]
    assert target["reached"] and target["step"] == 5 and target["target_val_bpb"] == 5 and target["val_bpb"] <= 5
    first_val = next(r for r in read_metrics(run_dir) if "val_loss" in r)
    assert first_val["val_loss"] > 5 >= first_val["val_bpb"], first_val  # the figures on either side
    assert end_record(run_dir)["summary"]["steps"] == 5
