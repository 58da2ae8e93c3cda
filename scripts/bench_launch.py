"""What a multi-process launch costs before its first step: the same one-step run of the tiny model
with its workers forked from a forkserver (launch.start_method=forkserver, the default) and spawned
(launch.start_method=spawn, each worker a fresh interpreter), alternating, round after round. With
--against DIR: this checkout's launch against the checkout in DIR (a `git worktree` or clone of
another commit), both forked, to measure a change to how dtrain starts.

    .venv/bin/python scripts/bench_launch.py [--rounds 5] [--worlds 2 4] [--steps 1] [--against DIR]
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


def launch(run_dir: Path, world: int, method: str, steps: int, extra: list[str],
           checkout: Path = REPO) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of the dtrain in `checkout` (`python -m trainer` there
    imports that folder's package first)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainer", "train", "model=tiny", "parallel=ddp", f"world={world}",
           f"launch.start_method={method}", f"train.max_steps={steps}", "train.val_interval=0",
           "train.sample_tokens=0", "checkpoint.interval=0", "train.progress=false", "train.log_interval=1",
           "resume=never", f"hydra.run.dir={run_dir}", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
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
    parser.add_argument("--against", type=Path, help="another checkout, launched against this one")
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    # (label, checkout, start method): the first is the baseline the last column divides by
    if args.against is not None:
        variants = [(args.against.resolve().name, args.against.resolve(), "forkserver"),
                    ("this checkout", REPO, "forkserver")]
    else:
        variants = [(method, REPO, method) for method in METHODS]
    figures: dict[tuple[int, str], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as tmp:
        run_dir = Path(tmp) / "run"
        for _, checkout, _ in variants:  # prepares the default dataset (each checkout's own), untimed
            launch(run_dir, 1, "forkserver", 1, args.extra, checkout)
        for round_ in range(1, args.rounds + 1):
            for world in args.worlds:
                # alternate which goes first, so a drift in the machine's load favours neither
                for label, checkout, method in variants if round_ % 2 else variants[::-1]:
                    wall, cpu = launch(run_dir, world, method, args.steps, args.extra, checkout)
                    runs = figures.setdefault((world, label), {"wall": [], "cpu": []})
                    runs["wall"].append(wall)
                    runs["cpu"].append(cpu)
                    print(f"round {round_}  world {world}  {label:14s}  wall {wall:6.2f} s  cpu {cpu:6.2f} s",
                          flush=True)
    baseline = variants[0][0]
    print(f"\n{args.steps}-step tiny run, {args.rounds} rounds, medians (range), seconds:\n")
    compared = "checkout" if args.against else "start method"
    print(f"| world | {compared} | wall | CPU (all processes) | CPU / {baseline}'s |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        base_cpu = statistics.median(figures[(world, baseline)]["cpu"])
        for label, _, _ in variants:
            runs = figures[(world, label)]
            ratio = statistics.median(runs["cpu"]) / base_cpu
            print(f"| {world} | {label} | {summary(runs['wall'])} | {summary(runs['cpu'])} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
