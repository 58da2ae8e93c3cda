"""The checkpoint state of a mode whose Muon runs by owner rank (trainer/parallel/muon_owners.py
OwnedMuon): its momenta whole under their parameter names, written by their owners, beside an
elementwise optimizer that DCP saves and loads as the base Strategy does.

A Strategy mixin (fsdp, hsdp; none, whose Muon is owned only under tensor parallelism). Kept apart
from muon_owners.py, which imports DTensor: a one-process run's path imports neither.
"""

from __future__ import annotations

import torch

from trainer.optim.build import parts


class OwnedMatrixState:
    @staticmethod
    def _split(optimizer) -> tuple[torch.optim.Optimizer, object | None]:
        """(the rest of the optimizer, its part that saves by name, or None)."""
        found = parts(optimizer)
        muon = next((p for p in found if getattr(p, "saves_by_name", False)), None)
        if muon is None:  # no Muon, or one that every rank steps whole (parallel=none at tp 1)
            return optimizer, None
        return next(p for p in found if p is not muon), muon

    def optimizer_state_dict(self, model, optimizer):
        elementwise, muon = self._split(optimizer)
        state = super().optimizer_state_dict(model, elementwise)
        return {**state, **muon.state_dict_by_name()} if muon else state

    def optimizer_state_template(self, model, optimizer):
        elementwise, muon = self._split(optimizer)
        template = super().optimizer_state_template(model, elementwise)
        return {**template, **muon.state_template()} if muon else template

    def load_optimizer_state_dict(self, model, optimizer, state):
        elementwise, muon = self._split(optimizer)
        if muon:
            muon.load_state_by_name(state)
            state = {name: entry for name, entry in state.items() if name not in muon.names}
        super().load_optimizer_state_dict(model, elementwise, state)
