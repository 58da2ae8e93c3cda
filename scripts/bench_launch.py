"""What a multi-process launch costs before its first step: the same one-step run of the tiny model
with its workers forked from a forkserver (launch.start_method=forkserver, the default) and spawned
(launch.start_method=spawn, each worker a fresh interpreter), alternating, round after round.

    .venv/bin/python scripts/bench_launch.py [--rounds 5] [--worlds 2 4] [--steps 1]
                                             [-- extra overrides for every run]

Each launch is `dtrain train model=tiny parallel=ddp world=W` on the embedded default dataset (a
first run prepares it, untimed), no validation, sample or checkpoint. Wall is the command's seconds;
CPU is the user and system seconds of the command and every process under it (the driver waits for
its forkserver, which waits for its workers, so getrusage(RUSAGE_CHILDREN) holds them all). Prints
each run, then the medians (ranges) and a Markdown table for docs/performance.md.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("spawn", "forkserver")


def launch(run_dir: Path, world: int, method: str, steps: int, extra: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainer", "train", "model=tiny", "parallel=ddp", f"world={world}",
           f"launch.start_method={method}", f"train.max_steps={steps}", "train.val_interval=0",
           "train.sample_tokens=0", "checkpoint.interval=0", "train.progress=false", "train.log_interval=1",
           "resume=never", f"hydra.run.dir={run_dir}", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    figures: dict[tuple[int, str], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmp:
        run_dir = Path(tmp) / "run"
        launch(run_dir, 1, "forkserver", 1, args.extra)  # prepares the default dataset, untimed
        for round_ in range(1, args.rounds + 1):
            for world in args.worlds:
                # alternate which method goes first, so a drift in the machine's load favours neither
                for method in METHODS if round_ % 2 else METHODS[::-1]:
                    wall, cpu = launch(run_dir, world, method, args.steps, args.extra)
                    runs = figures.setdefault((world, method), {"wall": [], "cpu": []})
                    runs["wall"].append(wall)
                    runs["cpu"].append(cpu)
                    print(f"round {round_}  world {world}  {method:10s}  wall {wall:6.2f} s  cpu {cpu:6.2f} s",
                          flush=True)
    print(f"\n{args.steps}-step tiny run, {args.rounds} rounds, medians (range), seconds:\n")
    print("| world | start method | wall | CPU (all processes) | CPU / spawn's |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        spawn_cpu = statistics.median(figures[(world, "spawn")]["cpu"])
        for method in METHODS:
            runs = figures[(world, method)]
            ratio = statistics.median(runs["cpu"]) / spawn_cpu
            print(f"| {world} | {method} | {summary(runs['wall'])} | {summary(runs['cpu'])} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
