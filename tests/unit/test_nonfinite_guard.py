"""The non-finite guard's verdict on one step (trainer/fit/nonfinite.py), in-process: a finite loss
with a non-finite gradient norm (what an overflow in the backward gives) is a non-finite step, on
the host path and on the device path (found_inf) alike. The runs that inject a NaN loss
(tests/faults/test_nonfinite.py) make both figures non-finite at once, so they cannot tell."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config.schema import TrainConfig
from trainer.fit.nonfinite import NonFiniteGuard
from trainer.process.runtime import Runtime

ONE_PROCESS = Runtime(rank=0, local_rank=0, world=1, local_world=1, device=torch.device("cpu"), distributed=False)


def guard(action: str = "skip") -> NonFiniteGuard:
    return NonFiniteGuard(TrainConfig(on_nonfinite=action, max_nonfinite=3), ONE_PROCESS)


@pytest.mark.parametrize(("loss", "grad_norm", "finite"), [
    (2.5, 0.7, True),
    (math.nan, 0.7, False),
    (2.5, math.inf, False),  # the loss fine, the backward overflowed
    (2.5, math.nan, False),
])
def test_a_step_is_finite_only_when_its_loss_and_gradient_norm_are(loss, grad_norm, finite):
    host = guard()
    mean, found_inf = host.check(torch.tensor(loss), torch.tensor(grad_norm))
    assert found_inf is None and host.finite is finite and host.skipped == (0 if finite else 1)
    assert math.isnan(mean.item()) if math.isnan(loss) else mean.item() == loss  # the loss it logs
    device = guard()
    _, found_inf = device.check(torch.tensor(loss), torch.tensor(grad_norm), on_device=True)
    assert found_inf.item() == (0.0 if finite else 1.0)  # the update masked on device
    device.settle()
    assert device.finite is finite


def test_a_finite_step_ends_a_run_of_non_finite_ones():
    g = guard()
    g.check(torch.tensor(2.0), torch.tensor(math.inf))
    g.in_a_row = 2  # as respond() counts them
    g.check(torch.tensor(2.0), torch.tensor(1.0))
    assert g.finite and g.in_a_row == 0 and g.take_skips() == 1 and g.take_skips() == 0


@pytest.mark.parametrize("on_device", [False, True])
def test_figures_beside_the_check_are_read_with_it_and_do_not_decide_the_verdict(on_device):
    """A MoE model's aux loss rides the check's all-reduce (trainer/fit/experts.py): read in the same
    sync as the loss, and a non-finite aux alone is not the step's verdict (the loss, which holds it,
    is)."""
    g = guard()
    _, found_inf = g.check(torch.tensor(2.0), torch.tensor(1.0), on_device=on_device, beside=torch.tensor(0.25))
    if on_device:
        assert found_inf.item() == 0.0
        g.settle()
    assert g.finite and g.beside == [0.25] and (g.loss, g.grad_norm) == (2.0, 1.0)
    g.check(torch.tensor(2.0), torch.tensor(1.0), beside=torch.tensor(math.nan))
    assert g.finite and math.isnan(g.beside[0])
