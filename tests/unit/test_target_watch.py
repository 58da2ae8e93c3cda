"""What the train loop hands TargetWatch (trainer/fit/target.py): the whole validation result, from
which the watch picks the figure its target is in. Checked with figures whose loss and bits per byte
lie on either side of the target, so watching the wrong one gives the wrong answer."""

from __future__ import annotations

import pytest

from trainer.config.schema import TrainConfig
from trainer.fit.run import TrainState
from trainer.fit.target import TargetWatch

# a validation result as Run.val_figures gives it (a mixture's per-source figures beside the totals);
# the loss in nats is well above the bits per byte, as at the start of every run
FIGURES = {"val_loss": 10.8, "val_bpb": 4.2, "val_loss/web": 10.9, "val_bpb/web": 4.3}


def state_at(step: int) -> TrainState:
    return TrainState(step=step, tokens=step * 256, train_s=1.5, excluded_s={"evaluation": 0.5})


@pytest.mark.parametrize(("train", "figure", "stops"), [
    (TrainConfig(target_val_bpb=8.0), "val_bpb", True),  # bpb 4.2 <= 8 although the loss 10.8 is not
    (TrainConfig(target_val_loss=8.0), "val_loss", False),  # loss 10.8 > 8 although the bpb 4.2 is below
    (TrainConfig(target_val_bpb=4.25), "val_bpb", True),  # the whole validation's 4.2, not a source's 4.3
    (TrainConfig(target_val_loss=11.0), "val_loss", True),
])
def test_the_watch_judges_the_figure_its_target_names(train, figure, stops):
    watch = TargetWatch(train, flops_per_token=100.0)
    state = state_at(5)
    assert watch.reached(FIGURES, state) is stops
    if stops:
        assert state.target == {"reached": True, f"target_{figure}": getattr(train, f"target_{figure}"),
                                figure: FIGURES[figure], "step": 5, "tokens": 1280, "train_s": 1.5,
                                "excluded_s": {"evaluation": 0.5}, "flops": 128000.0}
    else:
        assert state.target is None


def test_the_loss_reaching_a_bits_per_byte_target_does_not_stop_the_run():
    # the later validation: the loss has come down to the target, the bits per byte not yet
    watch = TargetWatch(TrainConfig(target_val_bpb=3.0), flops_per_token=1.0)
    state = state_at(10)
    assert not watch.reached({"val_loss": 2.9, "val_bpb": 3.1}, state) and state.target is None
    state.step = 15
    assert watch.reached({"val_loss": 2.5, "val_bpb": 2.95}, state)
    assert state.target["val_bpb"] == 2.95 and state.target["step"] == 15 and "val_loss" not in state.target


def test_a_run_without_a_target_never_stops_at_one():
    watch = TargetWatch(TrainConfig(), flops_per_token=1.0)
    state = state_at(3)
    assert not watch.reached(FIGURES, state) and state.target is None and watch.record(state) is None
