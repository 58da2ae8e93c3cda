"""The run directory: one run per directory, what a directory already holds, and the config record.

A run directory belongs to one run: the command that made it (the same resolved config) continues
it after a crash, from its newest checkpoint or from the start; a finished run is not run again;
another run's outputs are never touched. While a run is alive its driver holds an OS lock on the
directory (flock on the folder itself, so taking it writes nothing), which the OS releases when
the process dies, kill -9 included.

Torch-free (the CLI checks a run directory before torch is imported, so a mistake is reported fast).
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint.integrity import check_chosen_files
from trainer.checkpoint.layout import (
    CHECKPOINT_DIR,
    checkpoint_step,
    has_checkpoint,
    latest_checkpoint,
    resolve_checkpoint,
)
from trainer.config.keys import BATCH_KEYS, comparable_keys, is_operational
from trainer.errors import UserError
from trainer.io import check_writable_dir, dotted_keys, flock_holder, new_file_mode, one_line, write_atomic
from trainer.observe.metrics import METRICS_FILE, read_metrics
from trainer.process.env import restart_count

CONFIG_RECORD = "resolved_config.json"


class RunDirState(enum.Enum):
    NEW = "new"  # nothing of a run there yet
    CONTINUE = "continue"  # this run's own outputs: go on from its newest checkpoint (or the start)
    FINISHED = "finished"  # this run already reached train.max_steps


def check_run_dir(run_dir: Path, resume: str, config: dict | None = None) -> RunDirState:
    """What run_dir holds for a run of `config` (the resolved config as plain data), or a UserError
    when it belongs to another run.

    resume=auto continues this run's own outputs; resume=never refuses a directory with outputs;
    resume=PATH must name a complete checkpoint (or a run directory with one) and continues it
    where no other run's outputs are (check_resume_target). Without `config`
    nothing tells this run's leftovers from another run's, so only a checkpoint can be continued.
    A restarted attempt of the same elastic job (TORCHELASTIC_RESTART_COUNT > 0) always continues.
    The folder must be writable (see trainer.io.check_writable_dir).
    """
    check_writable_dir(run_dir, f"run directory {run_dir}", "choose another hydra.run.dir=")
    if restart_count() > 0:
        return RunDirState.CONTINUE
    if resume not in ("auto", "never"):
        # An explicit checkpoint is the user's choice of what to continue, also with another
        # schedule or settings (the record is then rewritten with a line saying what changed).
        ckpt = resolve_checkpoint(resume)
        check_chosen_files(ckpt)  # CheckpointError naming what is wrong with PATH
        return check_resume_target(run_dir, resume, ckpt, config)
    has_outputs = (run_dir / METRICS_FILE).exists() or has_checkpoint(run_dir, complete=False)
    if not has_outputs:
        return RunDirState.NEW
    if resume == "never":
        raise UserError(
            f"run directory {run_dir} already holds a run's outputs and resume=never; "
            "choose another hydra.run.dir= or remove that directory"
        )
    recorded = read_record(run_dir)
    if config is None or recorded is None:
        if resume == "auto" and not has_checkpoint(run_dir):
            raise UserError(
                f"run directory {run_dir} already holds another run's outputs (metrics.jsonl, no complete "
                "checkpoint to resume); choose another hydra.run.dir= or remove that directory"
            )
        return RunDirState.CONTINUE
    check_same_run(run_dir, recorded, config)
    return RunDirState.FINISHED if _finished(run_dir, config) else RunDirState.CONTINUE


def check_resume_target(run_dir: Path, resume: str, ckpt: Path, config: dict | None = None) -> RunDirState:
    """Where resume=PATH (checkpoint `ckpt`) may write. A run directory holds one run, whose outputs
    (resolved_config.json, metrics.jsonl, checkpoints/step_*) a continuation of another run's
    checkpoint would overwrite: its metrics cut back to the checkpoint's step, its later checkpoints
    removed as abandoned. So resume=PATH goes on in a folder holding none of them (NEW: a run that
    starts from the checkpoint), in the folder `ckpt` is a checkpoint of (its run, continued from
    there on purpose), or in a folder whose record says its run was started by resume= of this same
    checkpoint: the same command again after a crash or a stop, which goes on from that run's own
    newest checkpoint (trainer/checkpoint/manager.py; from `ckpt` while it has none) or, finished,
    does nothing. Anything else is one UserError, nothing written."""
    held = run_outputs(run_dir)
    if not held:
        return RunDirState.NEW
    if owns_checkpoint(run_dir, ckpt):
        return RunDirState.CONTINUE
    started_from = (read_record(run_dir) or {}).get("resume")
    if started_from is not None and _same_checkpoint(started_from, resume, ckpt):
        return RunDirState.FINISHED if config is not None and _finished(run_dir, config) else RunDirState.CONTINUE
    named = "" if Path(resume).expanduser() == Path(ckpt) else f" (its newest checkpoint {ckpt})"
    raise UserError(
        f"run directory {run_dir} holds another run ({', '.join(held)}), and resume={resume}{named} is not one "
        "of its checkpoints: continuing it there would overwrite that run's outputs; choose another "
        f"hydra.run.dir= for the continuation, or resume={run_dir} to continue the run it holds"
    )


def run_outputs(run_dir: Path) -> list[str]:
    """What of a run `run_dir` holds: its record, its metrics, its checkpoints (complete or not)."""
    held = [name for name in (CONFIG_RECORD, METRICS_FILE) if (run_dir / name).exists()]
    root = run_dir / CHECKPOINT_DIR
    saves = [p for p in root.iterdir() if checkpoint_step(p) is not None] if root.is_dir() else []
    if saves:
        held.append(f"{len(saves)} checkpoint{'s' if len(saves) > 1 else ''}")
    return held


def owns_checkpoint(run_dir: Path, ckpt: Path) -> bool:
    """`ckpt` is one of run_dir's own checkpoints (under its checkpoints/ folder)."""
    return Path(ckpt).resolve().parent == (run_dir / CHECKPOINT_DIR).resolve()


def _same_checkpoint(recorded: str, resume: str, ckpt: Path) -> bool:
    """The run was started by resume=`recorded`: as typed now, or naming the same checkpoint."""
    if not isinstance(recorded, str) or recorded in ("auto", "never"):
        return False
    if recorded == resume:
        return True
    try:
        return resolve_checkpoint(recorded).resolve() == Path(ckpt).resolve()
    except UserError:  # that checkpoint is gone: another run's start
        return False


def check_same_run(run_dir: Path, recorded: dict, config: dict, source: Path | None = None) -> None:
    """Refuse a changed trajectory key (trainer/config/keys.py); operational keys may change. A
    key in neither table (a record from another version) counts as trajectory. `source`: the file
    `recorded` was read from (the run's resolved_config.json unless a checkpoint's config.json)."""
    was, now = comparable_keys(recorded), comparable_keys(config)
    on_purpose = f"resume={run_dir} continues its newest checkpoint with the new settings on purpose"
    steps_key = "train.max_steps"
    if was.get(steps_key) != now.get(steps_key):
        raise UserError(
            f"run directory {run_dir} holds a run with train.max_steps={was.get(steps_key)}, not "
            f"{now.get(steps_key)}: its learning-rate schedule depends on it; repeat "
            f"train.max_steps={was.get(steps_key)} to continue it, {on_purpose}, or choose another hydra.run.dir="
        )
    # With a checkpoint, the batch keys are checked as the global batch it recorded (check_continuation).
    by_batch = BATCH_KEYS if has_checkpoint(run_dir) else ()
    differ = trajectory_changes(recorded, config, skip=by_batch)
    if differ:
        shown = ", ".join(f"{k}={_short(was.get(k))} there vs {_short(now.get(k))}" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise UserError(
            f"run directory {run_dir} already holds another run's outputs ({shown}{more}: settings that change "
            f"what it learns); repeat them ({source or run_dir / CONFIG_RECORD}) to continue it, {on_purpose}, "
            "or choose another hydra.run.dir="
        )


def trajectory_changes(recorded: dict, config: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys, other than operational ones and `skip`, whose values differ."""
    was, now = comparable_keys(recorded), comparable_keys(config)
    return [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k) and not is_operational(k)
            and k not in skip]


def _finished(run_dir: Path, config: dict) -> bool:
    """The run logged its end-of-run summary at train.max_steps, or where it met its target
    (trainer/fit/target.py) unless now told to go on after it (and a checkpoint, if any, agrees)."""
    summary = [r for r in read_metrics(run_dir / METRICS_FILE) if isinstance(r.get("summary"), dict)]
    if not summary:
        return False
    at_target = (summary[-1].get("target") or {}).get("reached") and not config["train"].get("continue_after_target")
    last = summary[-1].get("step") if at_target else config["train"]["max_steps"]
    if summary[-1].get("step") != last:
        return False
    newest = latest_checkpoint(run_dir)
    return newest is None or checkpoint_step(newest) == last


def finished_message(run_dir: Path) -> str:
    records = read_metrics(run_dir / METRICS_FILE)
    summary = next(r["summary"] for r in reversed(records) if isinstance(r.get("summary"), dict))
    best = summary.get("best_val_loss")
    best_text = f", best val loss {best:.4f}" if isinstance(best, (int, float)) else ""
    return (f"run {run_dir} already finished (step {summary.get('steps')}, final train loss "
            f"{summary.get('final_loss', float('nan')):.4f}{best_text}); nothing to do. To train it further, "
            f"name its checkpoint: train.max_steps=N resume={run_dir}; to start afresh, hydra.run.dir=ANOTHER_DIR")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_record(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / CONFIG_RECORD).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {run_dir / CONFIG_RECORD} ({one_line(err)}); it records the run "
                        "that owns this directory: restore it, or choose another hydra.run.dir=") from None


def write_config_record(run_dir: Path, cfg_dict: dict) -> str | None:
    """Record the resolved config; when it replaces a different record (a continuation launched
    another way), returns a line saying what changed, for the caller to print (never silent)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg_dict, indent=2, sort_keys=True)
    path = run_dir / CONFIG_RECORD
    previous = read_record(run_dir)
    if previous is not None and json.dumps(previous, indent=2, sort_keys=True) == text:
        return None
    write_atomic(path, text, mode=new_file_mode())
    if previous is None:
        return None
    was, now = dotted_keys(previous), dotted_keys(cfg_dict)
    changed = [f"{k} {_short(was.get(k))} -> {_short(now.get(k))}" for k in sorted(set(was) | set(now))
               if was.get(k) != now.get(k)]
    return (f"continuing the run in {run_dir} with changed settings: {', '.join(changed)} "
            f"({CONFIG_RECORD} updated)")


def read_config_record(run_dir: Path) -> dict:
    path = run_dir / CONFIG_RECORD
    if not path.exists():
        raise UserError(
            f"{run_dir} is not a dtrain run directory (no {CONFIG_RECORD}); pass a run's output folder"
        )
    return json.loads(path.read_text())


# --- one run per directory ---------------------------------------------------------------------
class RunDirLock:
    """An OS lock (flock) on the run directory itself, held by the driver for the run's life.

    `probe()` takes it if the directory exists (writing nothing), so a second run there is refused
    before any check reads the directory; `claim()` creates the directory if needed and takes it.
    The OS releases it when the process ends in any way. `flock_held` (trainer.io) tells from
    outside whether a live process holds it (a sweep point's status; see trainer.observe.results).
    """

    what = "run directory"  # the folder and who holds it, as the refusal names them
    holder = "dtrain run"
    choose = "hydra.run.dir="
    PROBE_RETRIES = 3  # a `flock_held` probe holds its shared lock for microseconds: not a run

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.fd: int | None = None
        self.held: list[int] = []  # other locks the run holds for its life (its dataset folder's)

    def hold(self, fd: int) -> None:
        """Keep `fd` (holding a lock) open until this lock is released."""
        self.held.append(fd)

    def probe(self) -> RunDirLock:
        if self.fd is None and self.run_dir.is_dir():
            self._take()
        return self

    def claim(self) -> None:
        if self.fd is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._take()

    def _take(self) -> None:
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        for attempt in range(self.PROBE_RETRIES + 1):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt < self.PROBE_RETRIES:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                holder = flock_holder(self.run_dir)
                who = f" (pid {holder})" if holder else ""
                raise UserError(
                    f"{self.what} {self.run_dir} is in use by another {self.holder}{who}; wait for it to end, "
                    f"or choose another {self.choose}"
                ) from None
        self.fd = fd

    def release(self) -> None:
        while self.held:
            os.close(self.held.pop())
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.probe()

    def __exit__(self, *exc) -> None:
        self.release()
