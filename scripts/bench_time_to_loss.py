"""Time to make train's loss: experiment=shakespeare_cpu (AdamW, what `make train` runs) against
experiment=shakespeare_fast (Muon), one after the other on this machine.

    .venv/bin/python scripts/bench_time_to_loss.py [--eval-interval 10] [--out DIR] [--keep]
                                                   [-- extra overrides for both runs]

Both runs get the same eval settings (validation every --eval-interval steps, the experiments'
val_tokens) and no sample or periodic checkpoint, so the clock is training and evaluation alike.
The target is the validation loss shakespeare_cpu ends at; its time is that final evaluation's.
shakespeare_fast's time is its first evaluation at or below the target. Times come from each run's
metrics.jsonl: from the start of step 1 (its record's time minus its own duration) to the
evaluation record's time. Prints both, the ratio, and a Markdown table for docs/optimizers.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = ("shakespeare_cpu", "shakespeare_fast")


def train(experiment: str, run_dir: Path, val_interval: int, extra: list[str]) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainer", "train", f"experiment={experiment}", f"hydra.run.dir={run_dir}",
           f"train.val_interval={val_interval}", "train.sample_tokens=0", "checkpoint.interval=0",
           "train.progress=false", "resume=never", *extra]
    print("$ dtrain " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_time(records: list[dict]) -> float:
    first = next(r for r in records if "loss" in r)
    return first["time"] - first["tokens"] / first["tokens_per_s"]


def evaluations(records: list[dict]) -> list[dict]:
    return [r for r in records if "val_loss" in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval-interval", type=int, default=10, help="validation every N steps in both runs")
    parser.add_argument("--out", type=Path, help="where the two runs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("extra", nargs="*", help="overrides for both runs (after --)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="dtrain_time_to_loss_"))
    try:
        base = train(RUNS[0], out / RUNS[0], args.val_interval, args.extra)
        fast = train(RUNS[1], out / RUNS[1], args.val_interval, args.extra)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    final = evaluations(base)[-1]
    target, base_s = final["val_loss"], final["time"] - start_time(base)
    hit = next((r for r in evaluations(fast) if r["val_loss"] <= target), None)
    best = min(r["val_loss"] for r in evaluations(fast))
    print(f"\ntarget: shakespeare_cpu's final validation loss {target:.4f} (step {final['step']}, {base_s:.1f} s)")
    if hit is None:
        print(f"shakespeare_fast never reached it (best {best:.4f})")
        return 1
    fast_s = hit["time"] - start_time(fast)
    ratio = fast_s / base_s
    print(f"shakespeare_fast: {hit['val_loss']:.4f} at step {hit['step']}, {fast_s:.1f} s")
    print(f"ratio: {ratio:.2f}x of shakespeare_cpu's time\n")
    print("| run | optimizer | steps to the target | tokens | seconds | ratio |")
    print("|---|---|---|---|---|---|")
    print(f"| shakespeare_cpu | AdamW | {final['step']} (final, {target:.4f}) | {final['tokens']:,} | "
          f"{base_s:.1f} | 1.00 |")
    print(f"| shakespeare_fast | Muon + AdamW | {hit['step']} ({hit['val_loss']:.4f}) | {hit['tokens']:,} | "
          f"{fast_s:.1f} | {ratio:.2f} |")
    return 0 if ratio <= 0.6 else 1


if __name__ == "__main__":
    sys.exit(main())
