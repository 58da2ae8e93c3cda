"""How the driver's workers start (trainer/launch/forkserver.py): forked from a forkserver that the
launch starts inside its own environment and stops after it, so two launches in one process (a
sweep's points) give their workers their own variables, and local rank 0 writes where the driver
does; `launch.start_method=spawn` makes each worker a fresh interpreter. Real world-2 launches
through torchrun's engine, from this process."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.dist_workers import PROBE_ENV, launch_probe
from helpers.processes import children
from omegaconf import OmegaConf

from trainer.config.schema import LaunchConfig, to_dict
from trainer.launch.workers import run_workers


def launch_section(start_method: str) -> dict:
    return {**to_dict(OmegaConf.structured(LaunchConfig)), "start_method": start_method}


def forkservers() -> list[int]:
    return [pid for pid in children(os.getpid())
            if b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_each_launch_forks_its_workers_from_a_forkserver_of_its_own(tmp_path, monkeypatch):
    results = []
    for value in ("first launch", "second launch"):
        monkeypatch.setenv(PROBE_ENV, value)
        results.append(run_workers(launch_probe, (), launch_section("forkserver"), 2, tmp_path / "logs"))
        assert not forkservers(), "the launch's forkserver outlived the launch"
    assert [r["probe"] for r in results] == ["first launch", "second launch"]
    assert [r["rank"] for r in results] == [0, 0]
    parents = [r["parent"] for r in results]
    assert os.getpid() not in parents, "the workers were not forked from a forkserver"
    assert parents[0] != parents[1], "the second launch reused the first one's forkserver"
    assert results[0]["stdout"] == os.readlink("/proc/self/fd/1"), "rank 0 does not write where the driver does"


def test_spawn_starts_each_worker_as_a_child_of_the_driver(tmp_path, monkeypatch):
    monkeypatch.setenv(PROBE_ENV, "spawned")
    result = run_workers(launch_probe, (), launch_section("spawn"), 2, tmp_path / "logs")
    assert (result["probe"], result["parent"]) == ("spawned", os.getpid())
