#!/usr/bin/env python
"""The faults a cluster delivers, caused for real on a `parallel=ddp world=2` run, and the verdict.

    .venv/bin/python scripts/chaos.py [--steps 40] [--seed 0] [--keep DIR] [key=value overrides ...]
    make chaos

1. An uninterrupted reference run.
2. The same command, hit at random steps by: SIGKILL of one worker (torchrun's engine restarts the
   workers, which resume from the newest checkpoint), SIGTERM of the driver (it saves and exits
   143), a corrupted newest checkpoint (bytes flipped inside a shard while the job is down), and
   a re-run of the same command, which falls back to the newest intact checkpoint and finishes.
   Its final weights must equal the reference's bit for bit.
3. `train.on_nonfinite=rollback` with two injected non-finite steps (DTRAIN_INJECT_NONFINITE): the
   run must roll back, go on and end with finite weights.

One line per fault, then the verdict; exit 0 only when every check held. Without data overrides it
trains on the embedded Shakespeare dataset (prepared on first use).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.checkpoint.layout import checkpoint_step, latest_checkpoint  # noqa: E402
from trainer.observe.metrics import read_metrics  # noqa: E402
from trainer.weights.from_checkpoint import model_from_run  # noqa: E402

INTERVAL = 5  # steps between checkpoints


def run_args(run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    return ["train", "model=tiny", "parallel=ddp", "world=2", f"train.max_steps={steps}", "train.log_interval=1",
            "train.val_interval=0", "train.sample_tokens=0", "train.progress=false", "train.micro_batch_size=4",
            "train.seq_len=64", "optim.warmup_steps=5", f"checkpoint.interval={INTERVAL}", "checkpoint.keep=3",
            "launch.max_restarts=3", f"hydra.run.dir={run_dir}", *overrides]


def start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})


def logged_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r), default=0)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = logged_step(run_dir)
        if now >= step:
            return now
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}")
        time.sleep(0.05)
    raise RuntimeError(f"no step {step} within {timeout} s")


def worker_pids(driver: int) -> list[int]:
    """The driver's worker processes (torch's spawn children, not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == driver and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def flip_newest_shard(run_dir: Path) -> Path:
    ckpt = latest_checkpoint(run_dir)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        data = f.read(64)
        f.seek(shard.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return ckpt


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = model_from_run(run_dir)
    return model.state_dict()


def say(message: str) -> None:
    print(f"chaos: {message}", flush=True)


def chaos_run(root: Path, steps: int, overrides: list[str], rng: random.Random) -> Path:
    run_dir = root / "chaos"
    log = root / "chaos.log"
    args = run_args(run_dir, steps, overrides)
    kill_at = rng.randint(INTERVAL + 1, steps // 2 - 1)
    term_at = rng.randint(steps // 2 + 1, steps - INTERVAL - 1)
    proc = start(args, log)
    wait_for_step(run_dir, kill_at, proc)
    victim = rng.choice(worker_pids(proc.pid))
    os.kill(victim, signal.SIGKILL)
    say(f"SIGKILL to worker pid {victim} at step {logged_step(run_dir)}: the workers restart from the newest "
        f"checkpoint (step {checkpoint_step(latest_checkpoint(run_dir))})")
    at = wait_for_step(run_dir, term_at, proc)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    saved = latest_checkpoint(run_dir)
    say(f"SIGTERM to the driver after step {at} was logged: exit {code}, saved {saved.name}")
    if code != 128 + signal.SIGTERM:
        raise RuntimeError(f"the driver exited {code} after SIGTERM, not {128 + signal.SIGTERM}")
    corrupt = flip_newest_shard(run_dir)
    say(f"flipped 64 bytes inside {corrupt.name}'s first shard while the job was down")
    rerun = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, capture_output=True, text=True)
    with log.open("a") as f:
        f.write(rerun.stdout + rerun.stderr)
    fallback = next((line for line in rerun.stderr.splitlines() if "is corrupt" in line), "no fallback line")
    say(f"re-ran the same command: exit {rerun.returncode}; {fallback.removeprefix('dtrain: ')}")
    if rerun.returncode != 0:
        raise RuntimeError(f"the re-run failed (exit {rerun.returncode}): {rerun.stderr[-2000:]}")
    return run_dir


def rollback_run(root: Path, steps: int, overrides: list[str], rng: random.Random) -> bool:
    run_dir = root / "rollback"
    bad = sorted(rng.sample(range(INTERVAL + 2, steps), 2))
    env = {"DTRAIN_INJECT_NONFINITE": ",".join(map(str, bad))}
    args = run_args(run_dir, steps, [*overrides, "train.on_nonfinite=rollback"])
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env})
    (root / "rollback.log").write_text(proc.stdout + proc.stderr)
    finite = proc.returncode == 0 and all(bool(torch.isfinite(t).all()) for t in final_weights(run_dir).values())
    if proc.returncode != 0:
        say(f"the rollback run failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
    rolled = [line for line in proc.stderr.splitlines() if "roll" in line.lower()]
    say(f"non-finite loss injected at steps {bad} with train.on_nonfinite=rollback: exit {proc.returncode}, "
        f"{len(rolled)} rollback line(s), final weights {'finite' if finite else 'NOT finite'}")
    return finite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of each run (default 40)")
    ap.add_argument("--seed", type=int, default=None, help="picks the fault steps (default: random)")
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="dtrain config overrides (key=value), e.g. data=...")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 16)
    rng = random.Random(seed)
    root = args.keep or Path(tempfile.mkdtemp(prefix="dtrain-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    say(f"seed {seed}; ddp world 2, {args.steps} steps, checkpoints every {INTERVAL}; logs in {root}")
    reference = root / "reference"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "trainer", *run_args(reference, args.steps, args.overrides)], cwd=REPO,
                   check=True, capture_output=True)
    say(f"reference run: {args.steps} steps uninterrupted ({time.perf_counter() - t0:.0f} s)")
    chaos = chaos_run(root, args.steps, args.overrides, rng)
    ours, theirs = final_weights(chaos), final_weights(reference)
    same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    differing = [k for k in ours if k in theirs and not torch.equal(ours[k], theirs[k])]
    say(f"final weights after the faults vs the uninterrupted run: "
        f"{'bitwise equal' if same else f'{len(differing)} tensors differ'} ({len(ours)} tensors)")
    finite = rollback_run(root, args.steps, args.overrides, rng)
    ok = same and finite
    say(f"verdict: {'PASS' if ok else 'FAIL'} (bitwise after faults: {same}; finite after rollback: {finite})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
