"""Every gloo group a run makes runs its collectives on one worker thread per device
(trainer/process/runtime.py: torch's second thread let a group's next collective start while the
last one was still being torn down, and a tensor-parallel worker crashed there). Real world-2
launches through torchrun's engine."""

from __future__ import annotations

import pytest
from helpers.dist_workers import every_rank, gloo_group_threads


@pytest.mark.parametrize("interfaces", [pytest.param(None, id="default-device"),
                                        pytest.param("lo", id="GLOO_SOCKET_IFNAME", marks=pytest.mark.slow)])
def test_every_gloo_group_runs_on_one_thread_per_device(interfaces, monkeypatch):
    if interfaces is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interfaces)
    found = every_rank(gloo_group_threads, 2)
    for rank in (0, 1):
        assert set(found[rank]) == {"world", "mesh", "new_group"}
        for name, group in found[rank].items():
            assert (group["devices"], group["threads"]) == (1, 1), f"rank {rank}'s {name} group"
            assert group["sum"] == 3.0, f"rank {rank}'s {name} group summed wrong"
