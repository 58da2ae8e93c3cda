"""Saving and restoring a training run's checkpoints: every rank builds one Checkpointer.

Every rank writes its own DCP shards; rank 0 alone writes the JSON files and the marker,
publishes the folder with one rename, and applies retention (the layout: trainer.checkpoint).
A save can run in the background (checkpoint.async_save) and is published when it completes.
"""

from __future__ import annotations

import errno
import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.deferred import dcp, verify
from trainer.checkpoint.finite import describe_nonfinite, module_state_bytes, nonfinite_tensors, state_bytes
from trainer.checkpoint.integrity import checksum_files, marker_record, rank_files
from trainer.checkpoint.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    DEL_PREFIX,
    FORMAT_VERSION,
    MARKER,
    STATE_FILE,
    TMP_PREFIX,
    checkpoint_step,
    has_marker,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    step_dir_name,
)
from trainer.checkpoint.resume_notes import ran_with, resume_notes
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.selection import check_explicit, choose_own
from trainer.checkpoint.space import folder_bytes, make_room, remove_checkpoint
from trainer.checkpoint.trainer_state import restore_counters, state_record
from trainer.config.schema import to_dict
from trainer.data.identity import recorded_identity
from trainer.errors import CheckpointError, ConfigError, NonFiniteError
from trainer.io import dotted_keys, first_line, fsync_dir, write_durable
from trainer.process.env import restart_count
from trainer.process.joblog import say
from trainer.tokenizers.load import load_tokenizer


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
        if rt.distributed:
            # An async save and the checksums of every save run their collectives in the
            # background; a separate gloo group keeps them apart from the training thread's.
            self.pg = dist.new_group(backend="gloo")
        # (future of every rank's checksums, tmp folder, final folder, step, JSON record) of a save
        # not yet published
        self.pending = None
        # Hashes a save's files once written, so the checksums cost the training thread no time
        # (the training continues meanwhile; measured in scripts/bench_checksum.py).
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrain-checksum")
        self.resumed_from: Path | None = None
        # The identity of the data and tokenizer this run reads (rank 0 writes it into every checkpoint).
        self.identity = recorded_identity(cfg.data) if rt.is_main else {}
        # Its tokenizer's files as the run reads them, copied into every checkpoint (none for GPT-2's:
        # trainer/checkpoint/tokenizer_copy.py)
        self.tokenizer_files = load_tokenizer(cfg.tokenizer).files if rt.is_main else {}
        self.last_saved: Path | None = None  # the newest save of this process (published or in flight)
        self.last_bytes = 0  # the bytes of the newest checkpoint (what the next one needs), on rank 0

    def _say(self, message: str) -> None:
        if self.rt.is_main:
            say(message)

    # --- restore ---
    def _choose(self) -> tuple[str, object, dict] | None:
        """Rank 0: clean up interrupted saves, then pick and check the checkpoint to resume; returns
        (its path, its DCP index, its trainer state) for every rank, or None to start afresh."""
        try:
            self._cleanup()
            resume = self.cfg.resume
            named = None if resume in ("auto", "never") else resolve_checkpoint(resume)
            # resume=never refused this run dir up front. Own checkpoints first: resume=auto, a restarted job,
            # a resume= of another run's checkpoint typed again once this run saved its own (preflight/rundir.py)
            foreign = named is not None and named.resolve().parent != self.root.resolve()
            if ((restart_count() > 0 or resume == "auto" or foreign)
                    and (chosen := choose_own(self.root, self.cfg.model, self._say)) is not None):
                ckpt, checked = chosen
            elif named is not None:
                ckpt, checked = check_explicit(named, self.cfg.model)
            else:
                return None
            metadata, saved, _ = checked
        except OSError as err:
            raise CheckpointError(f"cannot read checkpoints under {self.root}: {first_line(err)}") from None
        return str(ckpt), metadata, saved

    def _cleanup(self) -> None:
        """Remove interrupted saves: folders without a marker. A marked folder's save finished, so
        whatever is wrong with it since is corruption (set aside by choose_own, never deleted)."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            stale = path.name.startswith((TMP_PREFIX, DEL_PREFIX)) or (
                checkpoint_step(path) is not None and not has_marker(path)
            )
            if stale and path.is_dir():
                self._say(f"removing the interrupted checkpoint save {path.name}")
                shutil.rmtree(path, ignore_errors=True)

    def restore(self, run) -> None:
        """Load model, optimizer, counters, loader position and RNG states when resuming."""
        # Rank 0 checks the checkpoint once; the other ranks take its index and state from it.
        choice = self.rt.from_main(self._choose, error=CheckpointError)
        if choice is None:
            return
        path, metadata, saved = choice
        ckpt = Path(path)
        strategy, model, optimizer = run.strategy, run.model, run.optimizer
        template = {
            "model": strategy.model_state_dict(model),
            "optim": strategy.optimizer_state_template(model, optimizer),
        }
        verify().check_template(ckpt, metadata, dotted_keys(template))
        try:
            dcp().load(template, storage_reader=verify().SafeReader(ckpt))
        except verify().DCP_ERRORS as err:
            cause = first_line(verify().root_cause(err))
            raise CheckpointError(f"checkpoint {ckpt} could not be read: {cause}") from None
        strategy.load_model_state_dict(model, template["model"])
        strategy.load_optimizer_state_dict(model, optimizer, template["optim"])

        state = run.state
        restore_counters(state, saved)
        rank = self.rt.rank
        loaders, rngs = saved["loaders"], saved["rng"]
        # The data position is the same on every rank (world-independent); RNG streams start
        # identical on every rank, so a rank the old world did not have takes rank 0's.
        run.train_loader.load_state_dict(loaders[rank] if rank < len(loaders) else loaders[0])
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0], self.rt.device)
        self.resumed_from = ckpt
        self._say(f"resuming from {ckpt} (step {state.step})")
        if self.rt.is_main:
            self.last_bytes = folder_bytes(ckpt)
            now = ran_with(self.cfg, self.rt, run.plan, torch.get_num_threads())
            for note in resume_notes(ckpt, saved, now, self.identity, self.cfg.data):
                say(note)

    def check_room_at_start(self, run) -> None:
        """Before the first step: room for a checkpoint as large as the one resumed, or for a fresh
        run's weights at least (its optimizer state appears at the first step)."""
        if self.resumed_from is not None:
            self._check_room(self.last_bytes, f"at the start (nothing trained since {self.resumed_from.name})")
            return
        # model_state_dict's figure without DCP, which a fresh run imports only at its first save
        weights = module_state_bytes(run.strategy.unwrap(run.model))
        self._check_room(sum(self.rt.all_gather_object(weights)), "at the start (nothing trained yet)")

    # --- save ---
    def after_step(self, run, last: bool) -> bool:
        """Save when the step is due (every `interval` steps, and at the end); True if it saved."""
        self._poll()
        step = run.state.step
        if not (last or (self.interval and step % self.interval == 0)):
            return False
        final = self.save(run, wait=last)
        if not last:  # room for the next one, or stop now: no step is trained that could not be saved
            pending = self.pending[1] if self.pending is not None else None  # published on the way out
            self._check_room(self.last_bytes, f"after saving {final.name} (stopped before training on)",
                             pending=pending, newest=final, step=step)
        return True

    def _check_room(self, need: int, when: str, pending: Path | None = None, remove: bool = False,
                    newest: Path | None = None, step: int | None = None) -> None:
        """Every rank: room for a checkpoint of `need` bytes (trainer/checkpoint/space.py), else one
        CheckpointError line on every rank. `remove`: just before a save, what retention would
        remove after it anyway goes first if that makes room."""
        problem = None
        if self.rt.is_main:
            newest = newest or latest_checkpoint(self.root) or self.resumed_from
            problem = make_room(self.root, need, self.keep, when, newest, pending, self._say if remove else None, step)
        self.rt.agree(problem, CheckpointError)

    def save(self, run, wait: bool = True) -> Path:
        """Write a checkpoint. A synchronous save is published before returning when `wait`, else
        once its checksums are computed in the background (at a later step, the next save, or
        close()); an async save (checkpoint.async_save) is published once written and hashed."""
        self._finish_pending()
        step = run.state.step
        name = step_dir_name(step)
        tmp, final = self.root / (TMP_PREFIX + name), self.root / name
        strategy = run.strategy
        tensors = {
            "model": strategy.model_state_dict(run.model),
            "optim": strategy.optimizer_state_dict(run.model, run.optimizer),
        }
        # Every rank checks its own shards; the gather every save makes anyway tells all ranks.
        local = {"loader": run.train_loader.state_dict(), "rng": rng_state(self.rt.device),
                 "nonfinite": nonfinite_tensors(tensors), "bytes": state_bytes(tensors)}
        gathered = self.rt.all_gather_object(local)
        bad = sorted({n for g in gathered for n in g.get("nonfinite", [])})
        if bad:  # nothing written: the newest checkpoint stays the newest finite one
            previous = latest_checkpoint(self.root) or self.resumed_from
            raise NonFiniteError(
                f"refusing to save checkpoint {name}: {describe_nonfinite(bad)}; the newest finite checkpoint "
                f"is {previous or 'none (no checkpoint was written)'}; lower optim.lr, or see train.on_nonfinite"
            )
        self.last_bytes = sum(g["bytes"] for g in gathered)
        self._check_room(self.last_bytes, f"before saving {name} (not written)", remove=True, step=step)
        problem = None
        if self.rt.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as err:
                problem = self._save_problem(tmp, err)
        self.rt.agree(problem, CheckpointError)
        record = None
        if self.rt.is_main:
            record = state_record(run.state, ran_with(self.cfg, self.rt, run.plan, torch.get_num_threads()),
                                  self.identity, [g["loader"] for g in gathered], [g["rng"] for g in gathered])
        if self.async_save:
            try:
                future = dcp().async_save(tensors, checkpoint_id=tmp, process_group=self.pg)
            except verify().DCP_ERRORS as err:
                raise self._failed(tmp, err) from None
            self.pending = (self.hasher.submit(self._checksums_after, future, tmp), tmp, final, step, record)
            self.last_saved = final
            return final
        try:
            dcp().save(tensors, checkpoint_id=tmp)
        except verify().DCP_ERRORS as err:  # DCP raises the same error on every rank
            raise self._failed(tmp, err) from None
        written: Future = Future()
        written.set_result(None)
        self.pending = (self.hasher.submit(self._checksums_after, written, tmp), tmp, final, step, record)
        if wait:
            self._finish_pending(together=True)
        self.last_saved = final
        return final

    def save_now(self, run) -> Path:
        """Save this step (unless it was just saved) and wait until it is published: a stop."""
        final = self.root / step_dir_name(run.state.step)
        if self.last_saved != final:
            final = self.save(run)
        self.flush()
        return final

    def _own_checksums(self, tmp: Path) -> dict:
        try:
            return {"sums": checksum_files(tmp, rank_files(tmp, self.rt.rank))}
        except OSError as err:  # sent to rank 0 like a result, so no rank waits for another
            return {"error": f"rank {self.rt.rank}: {first_line(err)}"}

    def _checksums_after(self, future, tmp: Path) -> list[dict]:
        """In the hasher thread: wait for this rank's write, hash the files it wrote (still in its
        page cache), gather every rank's (on the background process group, apart from the training
        thread's collectives)."""
        future.result()
        own = self._own_checksums(tmp)
        if self.pg is None:
            return [own]
        parts: list = [None] * self.rt.world
        dist.all_gather_object(parts, own, group=self.pg)
        return parts

    def _failed(self, tmp: Path, err: BaseException) -> CheckpointError:
        """The error to raise for a failed save; rank 0 removes the partial folder (to free the
        space a full disk needs back, and so nothing half-written is left)."""
        message = self._save_problem(tmp, err)
        if self.rt.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointError(message)

    def _save_problem(self, tmp: Path, err: BaseException) -> str:
        cause = verify().root_cause(err)
        previous = latest_checkpoint(self.root.parent) if self.root.name == CHECKPOINT_DIR else None
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        name = tmp.name.removeprefix(TMP_PREFIX)
        reason = first_line(cause)
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

    def _publish(self, tmp: Path, final: Path, step: int, record: dict, parts: list[dict]) -> None:
        """Rank 0, once every rank's shards are written and hashed: JSON, the copy of the run's
        tokenizer (trainer/checkpoint/tokenizer_copy.py), the marker with every file's checksum
        (written last), one rename, retention."""
        errors = [p["error"] for p in parts if "error" in p]
        if errors:
            raise OSError(f"could not checksum the written files ({errors[0]})")
        write_durable(tmp / STATE_FILE, json.dumps(record))
        cfg_dict = to_dict(self.cfg) if not isinstance(self.cfg, dict) else self.cfg
        write_durable(tmp / CONFIG_FILE, json.dumps(cfg_dict, indent=2, sort_keys=True))
        copies = self.tokenizer_files
        for name, data in copies.items():
            write_durable(tmp / name, data)
        sums = {name: value for p in parts for name, value in p["sums"].items()}
        sums.update(checksum_files(tmp, [STATE_FILE, CONFIG_FILE, *copies]))
        marker = marker_record(tmp, step, self.rt.world, FORMAT_VERSION, sums)
        write_durable(tmp / MARKER, json.dumps(marker))
        fsync_dir(tmp)
        if final.exists():
            remove_checkpoint(final)  # the same step from an abandoned continuation (a resume from older)
        tmp.rename(final)
        fsync_dir(self.root)
        self._retain(step)

    def _retain(self, step: int) -> None:
        """Keep the newest `keep` checkpoints. Checkpoints past `step` belong to a continuation that
        a resume from an older checkpoint abandoned (its metrics were truncated too): removed."""
        done = list_checkpoints(self.root)
        abandoned = [p for p in done if checkpoint_step(p) > step]
        current = [p for p in done if checkpoint_step(p) <= step]
        for path in abandoned + current[: max(0, len(current) - self.keep)]:
            try:
                remove_checkpoint(path)
            except OSError as err:
                self._say(f"could not remove old checkpoint {path}: {first_line(err)}")

    # --- async completion ---
    def _poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self._finish_pending()

    def _finish_pending(self, together: bool = False) -> None:
        """Publish the pending save once its files are written and hashed. `together`: every rank
        is here, so a failure on rank 0 is raised on every rank."""
        if self.pending is None:
            if together:
                # _poll publishes when this rank's hashing is done, so another rank may still hold
                # the same save pending: its agree() below must meet one here, or it would take the
                # next object rank 0 broadcasts (a rollback's target path) for a save problem.
                self.rt.agree(None, CheckpointError)
            return
        hashed, tmp, final, step, record = self.pending
        self.pending = None
        try:
            parts = hashed.result()
        except verify().DCP_ERRORS as err:
            raise self._failed(tmp, err) from None
        problem = None
        if self.rt.is_main:
            try:
                self._publish(tmp, final, step, record, parts)
            except OSError as err:
                problem = str(self._failed(tmp, err))
        if together:
            self.rt.agree(problem, CheckpointError)
        elif problem:
            raise CheckpointError(problem)

    def flush(self) -> None:
        """Publish a save still in flight (every rank calls this together); saving goes on after."""
        self._finish_pending(together=True)

    def close(self) -> None:
        """Wait for a save still in flight and publish it; no save follows."""
        try:
            self._finish_pending()
        finally:
            self.hasher.shutdown()

