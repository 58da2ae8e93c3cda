"""bench_gpu.py's `watch` rows: what watching a run costs (issue 48's straggler timing and NCCL's
flight recorder, both on by default).

* straggler sample: dtrain's step under the profiler a sampled step runs in
  (StragglerWatch.around: CPU activity, and CUDA's on a GPU; then its own-time sum), against the
  same step unprofiled, in alternating blocks; the first sample apart (the profiler's start, CUPTI's
  on a GPU). A multi-process run samples one step in train.straggler_every (50).
* flight recorder: NCCL's ring buffer of each rank's collectives (trainer/process/hang_watch.py
  turns it on for CUDA runs). It reads its environment once per process, so each figure is a fresh
  process of its own (this file run as a script), on and off alternating: parallel=ddp's step at
  world 1 (a one-process NCCL group: DDP's bucket all-reduces and the step's check are real
  collectives) and the latency of a one-number all-reduce (the step's check). On a CPU the group is
  gloo's, which has no recorder: the rows then only rehearse the code.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # a fresh process of its own (flight_recorder)
    sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.harness import step_bookkeeping, sync  # noqa: E402
from trainer.config.schema import from_dict, to_dict  # noqa: E402
from trainer.fit.run import Run  # noqa: E402
from trainer.observe.stragglers import StragglerWatch  # noqa: E402
from trainer.process.hang_watch import FLIGHT_RECORDER_ENTRIES, flight_recorder_env  # noqa: E402
from trainer.process.runtime import init_runtime  # noqa: E402

RECORDER_VARIABLES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                      "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
ALL_REDUCES = 2000  # per latency figure


def straggler_sample(bench, model: str, batch: int) -> None:
    """The `watch` row of a sampled step's cost (in the benchmark's own process, no process group)."""
    cfg = bench.cfg(model, batch)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
        run = Run(cfg, bench.rt, Path(run_dir))
        steplog, metrics = step_bookkeeping(run, Path(run_dir))
        watch = StragglerWatch(cfg, bench.rt, lambda: run.read_s)
        done = [0]

        def plain(n):
            for _ in range(n):
                steplog.after_step(*run.train_step(done[0]))
                done[0] += 1

        def sampled(n):
            for _ in range(n):
                with watch.around(done[0] + 1, steplog):
                    steplog.after_step(*run.train_step(done[0]))
                done[0] += 1

        plain(bench.args.warmup)
        sync(bench.rt.device)
        t0 = time.perf_counter()
        sampled(1)  # the first: the profiler starts (CUPTI's initialization on a GPU)
        sync(bench.rt.device)
        first_s = time.perf_counter() - t0
        blocks = bench.alternate({"plain": plain, "sampled": sampled})
        metrics.close()
    plain_ms, sampled_ms = (statistics.median(blocks[k]) * 1e3 for k in ("plain", "sampled"))
    every = cfg.train.straggler_every
    share = (sampled_ms - plain_ms) / (every * plain_ms)
    bench.row("watch", f"{model} B={batch} straggler sample",
              f"{sampled_ms:.1f} ms/step sampled, first {first_s * 1e3:.0f} ms; "
              f"{share:+.2%} of a run's time at straggler_every={every}",
              f"unsampled {plain_ms:.1f} ms/step", f"{sampled_ms / plain_ms:.3f}x",
              figures=dict(ms=sampled_ms, default_ms=plain_ms, first_ms=first_s * 1e3, run_share=share))


def flight_recorder(bench, model: str, batch: int, rounds: int = 2) -> None:
    """The `watch` row of NCCL's flight recorder: fresh processes with it on and off, alternating."""
    cfg = bench.cfg(model, batch, "parallel=ddp", "world=1", "train.compile=false")
    figures: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as tmp:
        base = {k: v for k, v in os.environ.items() if k not in RECORDER_VARIABLES}
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        envs = {"on": {**base, **flight_recorder_env(Path(tmp))}, "off": {**base, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}}
        for r in range(rounds):
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                proc = subprocess.run([sys.executable, __file__, json.dumps(to_dict(cfg)), str(bench.args.warmup),
                                       str(bench.args.block * bench.args.rounds)],
                                      env=envs[name], capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"the recorder-{name} process failed: {proc.stderr.strip()[-300:]}")
                figures[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    on, off = ({k: statistics.median(f[k] for f in figures[name]) for k in ("step_ms", "all_reduce_us", "entries")}
               for name in ("on", "off"))
    backend = "nccl" if bench.rt.device.type == "cuda" else "gloo, which has no recorder"
    bench.row("watch", f"{model} B={batch} ddp world 1 ({backend}) flight recorder",
              f"on ({FLIGHT_RECORDER_ENTRIES} entries; {on['entries']:.0f} recorded): {on['step_ms']:.1f} ms/step, "
              f"all-reduce {on['all_reduce_us']:.1f} us",
              f"off: {off['step_ms']:.1f} ms/step, all-reduce {off['all_reduce_us']:.1f} us",
              f"{on['step_ms'] / off['step_ms']:.3f}x",
              figures=dict(on=figures["on"], off=figures["off"]))


def _recorded_entries() -> int:
    """How many collectives NCCL's flight recorder holds in this process (0 when off or absent)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None:
        return 0
    try:
        return len(pickle.loads(dump()).get("entries", []))
    except (RuntimeError, ValueError):
        return 0


def _measure_in_a_fresh_process(cfg_dict: dict, warmup: int, steps: int) -> dict:
    cfg = from_dict(cfg_dict)
    rt = init_runtime(cfg.train.device, True, 300, None)  # a one-process group: NCCL's on a GPU
    try:
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-gpu-") as run_dir:
            run = Run(cfg, rt, Path(run_dir))
            for step in range(warmup):
                run.train_step(step)
            sync(rt.device)
            t0 = time.perf_counter()
            for step in range(warmup, warmup + steps):
                run.train_step(step)
            sync(rt.device)
            step_s = (time.perf_counter() - t0) / steps
            del run
        one = torch.zeros(1, device=rt.device)
        for _ in range(50):
            dist.all_reduce(one)
        sync(rt.device)
        t0 = time.perf_counter()
        for _ in range(ALL_REDUCES):
            dist.all_reduce(one)
        sync(rt.device)
        all_reduce_s = (time.perf_counter() - t0) / ALL_REDUCES
        return {"step_ms": step_s * 1e3, "all_reduce_us": all_reduce_s * 1e6, "entries": _recorded_entries()}
    finally:
        rt.shutdown()


if __name__ == "__main__":
    print(json.dumps(_measure_in_a_fresh_process(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
