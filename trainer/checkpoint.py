"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one run directory:

    checkpoints/
      step_000012/            a complete checkpoint (published by one rename)
        .metadata             DCP's index of every tensor (written by rank 0)
        __0_0.distcp ...      DCP tensor shards (every rank writes its own)
        trainer_state.json    step, tokens, best val loss, every rank's loader position and RNG states
        config.json           the resolved config of the run that wrote it
        COMPLETE              the completion marker, written last
      .tmp_step_000016/       a save in progress (ignored and removed on the next start)

The DCP part holds tensors only: `model.<fqn>` (the model's parameters, full or sharded by the
strategy) and `optim.<fqn>.<name>` (AdamW's per-parameter state, keyed by parameter name so it
reshards across world sizes and modes). Everything else is JSON. Loading never unpickles an
arbitrary object: tensor data goes through torch.load(weights_only=True) inside DCP, and DCP's
`.metadata` index is read with an unpickler that only admits DCP's own metadata classes.

Only global rank 0 writes outside the DCP shard files: it creates the temporary folder, writes
the JSON files and the marker, renames the folder into place, and deletes old checkpoints.
"""

from __future__ import annotations

import base64
import errno
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from trainer.env import restart_count
from trainer.errors import CheckpointError, ConfigError
from trainer.parallel.base import tied_aliases
from trainer.rundir import CHECKPOINT_DIR

FORMAT_VERSION = 1
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
METADATA_FILE = ".metadata"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
DEL_PREFIX = ".del_"
# DCP warns on every single-process save and load (an async one warns from its thread).
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
# DCP reports a failure on any rank as CheckpointException, a BaseException.
DCP_ERRORS = (Exception, CheckpointException)
# Model fields that must agree between a checkpoint and the run that loads it.
MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "pad_vocab_multiple", "bias")


# --- finding checkpoints ---------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a `step_NNNNNN` folder name, or None for any other name."""
    name = Path(path).name
    if not name.startswith(STEP_PREFIX):
        return None
    try:
        return int(name[len(STEP_PREFIX):])
    except ValueError:
        return None


def is_complete(path: Path) -> bool:
    """A published checkpoint: its marker and DCP index are both there."""
    path = Path(path)
    return (path / MARKER).is_file() and (path / METADATA_FILE).is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints in a `checkpoints/` folder, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in found if s is not None) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory (or of a `checkpoints/` folder), or None."""
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == CHECKPOINT_DIR and not (run_dir / CHECKPOINT_DIR).is_dir() else (
        run_dir / CHECKPOINT_DIR
    )
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint folder from what a user typed: a `step_*` folder, a `checkpoints/` folder, or a
    run directory (its newest checkpoint). Raises CheckpointError naming what is wrong."""
    path = Path(spec).expanduser()
    if is_complete(path):
        return path
    if path.is_dir():
        if checkpoint_step(path) is not None or path.name.startswith(TMP_PREFIX):
            raise CheckpointError(
                f"{path} is an incomplete checkpoint (no {MARKER} marker: its save was interrupted); "
                "resume from an earlier step_* folder or the run directory"
            )
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        raise CheckpointError(
            f"{path} holds no complete checkpoint; pass a run directory with checkpoints/step_*, "
            "or one of those step_* folders"
        )
    raise CheckpointError(
        f"checkpoint {path} does not exist; pass a run directory with checkpoints/step_*, "
        "or one of those step_* folders"
    )


# --- reading a checkpoint safely -------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; this admits DCP's own metadata classes and nothing else."""

    ALLOWED_MODULES = (
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    )
    ALLOWED = {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a torch.layout from its name
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "getattr"),  # dtypes pickle as getattr(torch, "float32"); checked below
    }

    def find_class(self, module: str, name: str):
        if module in self.ALLOWED_MODULES or (module, name) in self.ALLOWED:
            if (module, name) == ("builtins", "getattr"):
                return _safe_getattr
            if module in self.ALLOWED_MODULES and name.startswith("__"):
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _safe_getattr(obj, name):
    if obj is torch and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"getattr({obj!r}, {name!r}) is not allowed in a checkpoint index")


def read_metadata(path: Path):
    """DCP's index of a checkpoint, read with the restricted unpickler."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {METADATA_FILE} (an incomplete save)") from None
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} has a corrupt {METADATA_FILE}: {_first_line(err)}"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path} has a corrupt {METADATA_FILE} (not a DCP index)")
    return metadata


class _SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)  # per-rank metadata: not used by dtrain
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path.parent} has no {path.name} ({what}); it is incomplete"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path.parent} has a corrupt {path.name}: {_first_line(err)}"
        ) from None


def read_checkpoint_config(ckpt: Path) -> dict:
    """The resolved config recorded by the run that wrote the checkpoint."""
    return read_json(Path(ckpt) / CONFIG_FILE, "the run's config")


def read_trainer_state(ckpt: Path) -> dict:
    return read_json(Path(ckpt) / STATE_FILE, "step, data position and RNG states")


def check_files(ckpt: Path, metadata) -> None:
    """Every shard file the index names exists and is long enough (catches missing or truncated
    shards before any rank starts reading)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = Path(ckpt) / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is missing shard file {name}; it is corrupt or partial")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint {ckpt} has a truncated shard file {name} ({size:,} bytes, needs {end:,}); "
                "it is corrupt or partial"
            )


def check_model_config(ckpt: Path, saved_cfg: dict, model_cfg) -> None:
    saved = saved_cfg.get("model", {})
    diffs = [
        f"{k}={saved.get(k)!r} vs {model_cfg[k]!r}" for k in MODEL_FIELDS if saved.get(k) != model_cfg[k]
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} was written for another model (model={saved.get('name')!r}: "
            f"{', '.join(diffs)} in this run); resume with the same model settings or use a new run dir"
        )


def check_template(ckpt: Path, metadata, flat_template: dict[str, torch.Tensor]) -> None:
    """Every tensor the load asks for is a tensor of the same shape in the checkpoint.

    A key stored as bytes would make DCP unpickle it; refusing it here keeps loading pickle-free.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = metadata.state_dict_metadata
    for key, tensor in flat_template.items():
        entry = entries.get(key)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {ckpt} has no entry {key!r}; it was written by another model or version"
            )
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {ckpt} stores {key!r} as a pickled object, not a tensor; refusing it"
            )
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {ckpt} holds {key} of shape {list(entry.size)} but this model's is "
                f"{list(tensor.shape)}; it was written for another model size"
            )


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The dotted keys DCP stores a nested dict of tensors under."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class _Quiet:
    """DCP warns on every single-process save and load; that is the intended use here."""

    def __enter__(self):
        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()


def validate_checkpoint(ckpt: Path, model_cfg=None) -> tuple[Any, dict, dict]:
    """Check a checkpoint before loading it; returns (DCP metadata, trainer state, config)."""
    ckpt = Path(ckpt)
    if not is_complete(ckpt):
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker or {METADATA_FILE})")
    metadata = read_metadata(ckpt)
    state = read_trainer_state(ckpt)
    cfg = read_checkpoint_config(ckpt)
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format {state.get('format')!r}; this dtrain reads {FORMAT_VERSION}"
        )
    if model_cfg is not None:
        check_model_config(ckpt, cfg, model_cfg)
    check_files(ckpt, metadata)
    return metadata, state, cfg


# --- loading weights without a training run ---------------------------------------------------
def load_model_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Load a checkpoint's full weights into a plain (unwrapped) GPT in this process.

    Works for a checkpoint written by any mode at any world size, with or without a process
    group in this process (the load is local: no collectives).
    """
    ckpt_dir = Path(ckpt_dir)
    metadata = read_metadata(ckpt_dir)
    check_files(ckpt_dir, metadata)
    aliases = tied_aliases(model)
    template = {k: v for k, v in model.state_dict().items() if k not in aliases}
    check_template(ckpt_dir, metadata, _flatten({"model": template}))
    try:
        with _Quiet():
            dcp.load({"model": template}, storage_reader=_SafeReader(ckpt_dir), no_dist=True)
    except CheckpointError:
        raise
    except DCP_ERRORS as err:
        raise CheckpointError(f"checkpoint {ckpt_dir} could not be read: {_first_line(err)}") from None
    model.load_state_dict({**template, **{a: template[n] for a, n in aliases.items()}})


def model_from_run(run_dir: Path, step: int | None = None, device: str | torch.device = "cpu"):
    """(GPT with the checkpoint's weights in eval mode, the run's config) for a run directory.

    `step=None` takes the newest complete checkpoint; `run_dir` may also be a checkpoint folder.
    """
    from trainer.config import from_dict
    from trainer.model import build_model

    run_dir = Path(run_dir)
    if step is not None:
        ckpt = run_dir / CHECKPOINT_DIR / step_dir_name(step)
        if not is_complete(ckpt):
            steps = [checkpoint_step(p) for p in list_checkpoints(run_dir / CHECKPOINT_DIR)]
            raise CheckpointError(
                f"{run_dir} has no complete checkpoint at step {step}; it has steps {steps or 'none'}"
            )
    elif is_complete(run_dir):
        ckpt = run_dir
    else:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            if not run_dir.exists():
                raise CheckpointError(f"run directory {run_dir} does not exist")
            raise CheckpointError(
                f"{run_dir} holds no complete checkpoint ({CHECKPOINT_DIR}/step_*); a run saves one at its "
                "end and every checkpoint.interval steps"
            )
    cfg = from_dict(read_checkpoint_config(ckpt))
    model = build_model(cfg.model)
    load_model_weights(model, ckpt)
    return model.to(device).eval(), cfg


# --- RNG and JSON helpers ---------------------------------------------------------------------
def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.uint8).copy())


def rng_state(device: torch.device) -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _write_file(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the step_* namespace first, so a kill midway
    never leaves a half-deleted folder that looks like a checkpoint."""
    if not path.exists():
        return
    doomed = path
    if not path.name.startswith((TMP_PREFIX, DEL_PREFIX)):
        doomed = path.with_name(DEL_PREFIX + path.name)
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)




# --- the training side --------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores one run's checkpoints; every rank builds one (collectives inside)."""

    def __init__(self, cfg, rt, run_dir: Path):
        self.cfg, self.rt = cfg, rt
        c = cfg.checkpoint
        if c.interval < 0:
            raise ConfigError(
                f"checkpoint.interval={c.interval} must be 0 (only at the end) or a number of steps"
            )
        if c.keep < 1:
            raise ConfigError(f"checkpoint.keep={c.keep} must be at least 1")
        self.interval, self.keep = c.interval, c.keep
        # Rank 0's run directory is the one checkpoints go to (every node must see it: shared
        # storage across nodes), so all ranks agree on one folder even where nodes differ.
        self.root = Path(self.rt.broadcast_object(str(Path(run_dir) / CHECKPOINT_DIR)))
        self.async_save = bool(c.async_save)
        self.pg = None
        if self.async_save and rt.distributed:
            # The background save runs its own collectives; a separate gloo group keeps them apart
            # from the training thread's.
            self.pg = dist.new_group(backend="gloo")
        self.pending = None  # (future, tmp folder, final folder, step, JSON record) of an async save
        self.resumed_from: Path | None = None

    def _agree(self, problem: str | None) -> None:
        """Rank 0's problem (or None) reaches every rank; all raise together."""
        problem = self.rt.broadcast_object(problem)
        if problem:
            raise CheckpointError(problem)

    def _say(self, message: str) -> None:
        if self.rt.is_main:
            print(f"dtrain: {message}", file=sys.stderr, flush=True)

    # --- restore ---
    def _choose(self) -> Path | None:
        """Rank 0: clean up interrupted saves, then pick and check the checkpoint to resume."""
        self._cleanup()
        resume = self.cfg.resume
        own = latest_checkpoint(self.root.parent) if self.root.name == CHECKPOINT_DIR else None
        if resume in ("auto", "never"):
            # resume=never refused this run dir up front; a restart of the same job still
            # continues its own checkpoints.
            ckpt = own if resume == "auto" or restart_count() > 0 else None
        else:
            ckpt = own if restart_count() > 0 and own is not None else resolve_checkpoint(resume)
        if ckpt is not None:
            validate_checkpoint(ckpt, self.cfg.model)
        return ckpt

    def _cleanup(self) -> None:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            stale = path.name.startswith((TMP_PREFIX, DEL_PREFIX)) or (
                checkpoint_step(path) is not None and not is_complete(path)
            )
            if stale and path.is_dir():
                self._say(f"removing the interrupted checkpoint save {path.name}")
                shutil.rmtree(path, ignore_errors=True)

    def restore(self, run) -> None:
        """Load model, optimizer, counters, loader position and RNG states when resuming."""
        choice, problem = None, None
        if self.rt.is_main:
            try:
                ckpt = self._choose()
                choice = None if ckpt is None else str(ckpt)
            except CheckpointError as err:
                problem = str(err)
            except OSError as err:
                problem = f"cannot read checkpoints under {self.root}: {_first_line(err)}"
        choice, problem = self.rt.broadcast_object((choice, problem))
        if problem:
            raise CheckpointError(problem)
        if choice is None:
            return
        ckpt = Path(choice)
        metadata, saved, _ = validate_checkpoint(ckpt, self.cfg.model)
        strategy, model, optimizer = run.strategy, run.model, run.optimizer
        template = {
            "model": strategy.model_state_dict(model),
            "optim": strategy.optimizer_state_template(model, optimizer),
        }
        check_template(ckpt, metadata, _flatten(template))
        try:
            with _Quiet():
                dcp.load(template, storage_reader=_SafeReader(ckpt))
        except DCP_ERRORS as err:
            raise CheckpointError(f"checkpoint {ckpt} could not be read: {_first_line(err)}") from None
        strategy.load_model_state_dict(model, template["model"])
        strategy.load_optimizer_state_dict(model, optimizer, template["optim"])

        state = run.state
        state.step = int(saved["step"])
        state.tokens = int(saved["tokens"])
        best, last = saved.get("best_val_loss"), saved.get("last_loss")
        state.best_val_loss = math.inf if best is None else float(best)
        state.last_loss = math.nan if last is None else float(last)
        rank = self.rt.rank
        loaders, rngs = saved["loaders"], saved["rng"]
        # The data position is the same on every rank (world-independent); RNG streams start
        # identical on every rank, so a rank the old world did not have takes rank 0's.
        run.train_loader.load_state_dict(loaders[rank] if rank < len(loaders) else loaders[0])
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0], self.rt.device)
        self.resumed_from = ckpt
        self._say(f"resuming from {ckpt} (step {state.step})")

    # --- save ---
    def after_step(self, run, last: bool) -> bool:
        """Save when the step is due (every `interval` steps, and at the end); True if it saved."""
        self._poll()
        step = run.state.step
        if not (last or (self.interval and step % self.interval == 0)):
            return False
        self.save(run)
        return True

    def save(self, run) -> Path:
        self._finish_pending()
        step = run.state.step
        name = step_dir_name(step)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        problem = None
        if self.rt.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as err:
                problem = self._save_problem(tmp, err)
        self._agree(problem)

        local = {"loader": run.train_loader.state_dict(), "rng": rng_state(self.rt.device)}
        gathered = self.rt.all_gather_object(local)
        strategy = run.strategy
        tensors = {
            "model": strategy.model_state_dict(run.model),
            "optim": strategy.optimizer_state_dict(run.model, run.optimizer),
        }
        record = None
        if self.rt.is_main:
            s = run.state
            record = {
                "format": FORMAT_VERSION,
                "step": s.step,
                "tokens": s.tokens,
                "best_val_loss": _json_float(s.best_val_loss),
                "last_loss": _json_float(s.last_loss),
                "world": self.rt.world,
                "parallel": self.cfg.parallel.mode,
                "total_batch_size": run.plan.total_batch_size,
                "time": time.time(),
                "loaders": [g["loader"] for g in gathered],
                "rng": [g["rng"] for g in gathered],
            }
        if self.async_save:
            try:
                future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=self.pg)
            except DCP_ERRORS as err:
                raise self._failed(tmp, err) from None
            self.pending = (future, tmp, final, step, record)
            return final
        try:
            with _Quiet():
                dcp.save(tensors, checkpoint_id=tmp)
        except DCP_ERRORS as err:  # DCP raises the same error on every rank
            raise self._failed(tmp, err) from None
        problem = None
        if self.rt.is_main:
            try:
                self._publish(tmp, final, step, record)
            except OSError as err:
                problem = str(self._failed(tmp, err))
        self._agree(problem)
        return final

    def _failed(self, tmp: Path, err: BaseException) -> CheckpointError:
        """The error to raise for a failed save; rank 0 removes the partial folder (to free the
        space a full disk needs back, and so nothing half-written is left)."""
        message = self._save_problem(tmp, err)
        if self.rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(message)

    def _save_problem(self, tmp: Path, err: BaseException) -> str:
        cause = err
        for _ in range(10):  # the root cause inside DCP's wrappers
            inner = _nested_failure(cause) or cause.__cause__
            if inner is None:
                break
            cause = inner
        previous = latest_checkpoint(self.root.parent) if self.root.name == CHECKPOINT_DIR else None
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        name = tmp.name.removeprefix(TMP_PREFIX)
        reason = _first_line(cause)
        # A full disk often surfaces as a serializer error ("unexpected pos ..."), not ENOSPC.
        need = sum(p.stat().st_size for p in previous.iterdir()) if previous else 0
        try:
            free = shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
        except OSError:
            free = None
        code = getattr(cause, "errno", None)
        if code == errno.ENOSPC or (code is None and free is not None and free < max(need, 2**20)):
            free_text = "" if free is None else f", {free / 2**20:,.0f} MiB free"
            reason = f"no space left on the device ({reason}{free_text})"
        return f"could not save checkpoint {name} under {self.root}: {reason}; {kept}"

    def _publish(self, tmp: Path, final: Path, step: int, record: dict) -> None:
        """Rank 0, once every rank's shards are written: JSON, marker, one rename, retention."""
        _write_file(tmp / STATE_FILE, json.dumps(record))
        from trainer.config import to_dict

        cfg_dict = to_dict(self.cfg) if not isinstance(self.cfg, dict) else self.cfg
        _write_file(tmp / CONFIG_FILE, json.dumps(cfg_dict, indent=2, sort_keys=True))
        marker = {"step": step, "world": self.rt.world, "format": FORMAT_VERSION}
        _write_file(tmp / MARKER, json.dumps(marker))
        _fsync_dir(tmp)
        if final.exists():
            _remove(final)  # the same step from an abandoned continuation (a resume from older)
        tmp.rename(final)
        _fsync_dir(self.root)
        self._retain(step)

    def _retain(self, step: int) -> None:
        """Keep the newest `keep` checkpoints. Checkpoints past `step` belong to a continuation that
        a resume from an older checkpoint abandoned (its metrics were truncated too): removed."""
        done = list_checkpoints(self.root)
        abandoned = [p for p in done if checkpoint_step(p) > step]
        current = [p for p in done if checkpoint_step(p) <= step]
        for path in abandoned + current[: max(0, len(current) - self.keep)]:
            try:
                _remove(path)
            except OSError as err:
                self._say(f"could not remove old checkpoint {path}: {_first_line(err)}")

    # --- async completion ---
    def _poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, step, record = self.pending
        self.pending = None
        try:
            future.result()
        except DCP_ERRORS as err:
            raise self._failed(tmp, err) from None
        if self.rt.is_main:
            try:
                self._publish(tmp, final, step, record)
            except OSError as err:
                raise self._failed(tmp, err) from None

    def close(self) -> None:
        """Wait for an async save still in flight and publish it."""
        self._finish_pending()


def _nested_failure(err: BaseException) -> BaseException | None:
    """The first per-rank exception inside DCP's CheckpointException, if any."""
    if isinstance(err, CheckpointException):
        for value in err.failures.values():
            exc = value[0] if isinstance(value, tuple) else value
            if isinstance(exc, BaseException):
                return exc
    return None


__all__ = [
    "Checkpointer",
    "latest_checkpoint",
    "list_checkpoints",
    "load_model_weights",
    "model_from_run",
    "resolve_checkpoint",
    "validate_checkpoint",
]
