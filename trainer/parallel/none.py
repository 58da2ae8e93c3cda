"""parallel=none: one process, one device; or, with parallel.tp > 1, one model split over the
tensor-parallel ranks (world = tp), Muon's matrices made whole on owner ranks."""

from trainer.parallel.base import Strategy, owned_muon_numels
from trainer.parallel.owned_state import OwnedMatrixState


class SingleStrategy(OwnedMatrixState, Strategy):
    name = "none"
    tensor_parallel = True

    @classmethod
    def muon_numels(cls, shapes, shape):
        if shape.tp == 1:
            return super().muon_numels(shapes, shape)
        return owned_muon_numels(shapes, shape.world, shape)  # matrix_optimizer's owners: every tp rank

    def matrix_optimizer(self, run):
        if self.rt.shape.tp == 1:
            return super().matrix_optimizer(run)
        # deferred: muon_owners imports DTensor (see base.tensor_parallel_plan), which a one-process run never needs
        from trainer.parallel.muon_owners import OwnedMuon

        # each rank holds its tensor-parallel rows of every matrix: gathered whole to an owner
        return OwnedMuon(run, rank=self.rt.rank, world=self.rt.world, sharded=True)
