"""`optim.fused` as typed on a command line: Hydra reads `true`/`false` as booleans, which the
string-typed key receives as 'True'/'False'; both spellings must choose the same optimizer."""

from __future__ import annotations

import pytest
import torch

from trainer.config.compose import compose
from trainer.config.validation import validate
from trainer.errors import ConfigError
from trainer.optim.adamw import adamw_kwargs


@pytest.mark.parametrize(("typed", "fused"), [("true", True), ("'true'", True), ("false", False),
                                              ("'false'", False), ("auto", False)])
def test_fused_choice_as_typed(typed, fused):
    cfg = compose([f"optim.fused={typed}"])
    validate(cfg)
    assert adamw_kwargs(cfg.optim, torch.device("cpu"))["fused"] is fused


def test_fused_rejects_other_words():
    with pytest.raises(ConfigError, match="optim.fused"):
        validate(compose(["optim.fused=sometimes"]))
