"""A continuation is checked against what the run was, caused for real: a stopped `parallel=ddp
world=2` run continued at world 1 changes the global batch (one line naming
train.total_batch_size=<the recorded value>; with it, the losses match the uninterrupted run within
1e-5), data prepared again from other text under a stopped run is one line that trains nothing, and
`dtrain prepare --force` under a live run is refused (a dead run's lock does not block it).

What the checkpoint itself records is checked, not only resolved_config.json: a crashed run whose
record was deleted refuses a changed lr (the checkpoint's config.json is the record then); a damaged
newest checkpoint is checked as resume=auto will treat it, by the older intact one it falls back to
(a batch change is refused, not skipped); another tokenizer under the same ids is refused; and a
continued run's metrics.jsonl ends with one summary record."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.checkpoints import copy_whole_run, crashed_copy, flip, snapshot
from helpers.dtrain import (
    SMALL_VOCAB,
    TOKENIZER_FOLDER,
    corpus_text,
    read_metrics,
    run_dtrain,
    tiny_args,
    tokenizer_args,
    train_losses,
)
from helpers.errors import one_line_error
from helpers.processes import finish, kill_group, logged, past_a_checkpoint, start_dtrain, wait_for
from helpers.runs import CKPT_ARGS, CKPT_NAMES, RESUMED

from trainer.checkpoint.layout import MARKER, STATE_FILE, latest_checkpoint, list_checkpoints
from trainer.checkpoint.records import newest_resumable
from trainer.config.compose import compose
from trainer.data.layout import as_data_cfg, dataset_dir
from trainer.errors import DataError
from trainer.observe.metrics import MetricsLogger
from trainer.observe.results import run_figures
from trainer.preflight.continuation import check_same_data
from trainer.preflight.rundir import CONFIG_RECORD, RunDirState, check_run_dir
from trainer.tokenizers.load import identity_of, load_tokenizer

STEPS = 10  # stopped after step 3: steps left to continue
STOP_ARGS = (f"train.max_steps={STEPS}", "checkpoint.interval=0")
DDP = ("parallel=ddp", "world=2")
ONE = ("parallel=none", "world=1")
GLOBAL_BATCH = 4 * 64 * 2  # tiny_args' micro batch x seq len x world 2


def stopped_run(args: list[str], run_dir: Path, log: Path, after_steps: int = 3) -> int:
    """Start `args`, let it log `after_steps` steps, SIGTERM the driver: it saves and exits 143.
    Returns the step it stopped at."""
    proc = start_dtrain(args, log)
    wait_for(lambda: logged(run_dir, at_least=after_steps), proc, log)
    os.kill(proc.pid, signal.SIGTERM)
    text = finish(proc, log)
    assert proc.returncode == 143, text[-3000:]
    (stopped,) = list_checkpoints(run_dir / "checkpoints")
    return int(stopped.name.split("_")[1])


def with_data(args: list[str], name: str) -> list[str]:
    """tiny_args on another prepared dataset (tiny_args' data.dir names its folder)."""
    return [a.replace("data.name=corpus", f"data.name={name}") for a in args]


def split_tokens(folder: Path) -> dict[str, int]:
    """{split: tokens} of a prepared dataset, from its manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return {split: sum(int(e["tokens"]) for e in entries) for split, entries in manifest["splits"].items()}


def prepare_text(root: Path, name: str, source: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_dtrain(["prepare", "data=text", f"data.name={name}", f"data.source={source}", f"data.dir={root}",
                       "data.val_fraction=0.1", *extra])


@pytest.mark.slow
def test_world_change_keeps_the_global_batch_or_says_so(data_dir, tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    run_dtrain(tiny_args(data_dir, reference, *STOP_ARGS, *DDP), check=True)
    stopped_at = stopped_run(tiny_args(data_dir, run_dir, *STOP_ARGS, *DDP), run_dir, tmp_path / "stopped.log")
    before = snapshot(run_dir)

    # the same command at world 1: the global batch would halve; one line naming the recorded total
    refused = run_dtrain(tiny_args(data_dir, run_dir, *STOP_ARGS, *ONE))
    line = one_line_error(refused)
    assert f"train.total_batch_size={GLOBAL_BATCH}" in line, line
    assert f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before, "a refused continuation wrote into the run directory"

    # with the recorded total given, it continues (accumulation 2) and matches the uninterrupted run
    run_dtrain(tiny_args(data_dir, run_dir, *STOP_ARGS, *ONE, f"train.total_batch_size={GLOBAL_BATCH}"), check=True)
    want, got = train_losses(reference), train_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) for s in range(stopped_at + 1, STEPS + 1))
    assert worst < 1e-5, f"continued at world 1 from step {stopped_at}: max |loss - uninterrupted| = {worst:.3g}"
    assert all(got[s] == want[s] for s in range(1, stopped_at + 1))


@pytest.mark.slow
def test_data_prepared_again_from_other_text_is_refused_and_resume_says_so(tmp_path):
    """The same command refuses the run's data prepared again from other text; resume=<its checkpoint>
    continues on the new data on purpose, saying so in one line (on stderr and in dtrain.log) that
    names what changed (issue 45: it continued silently)."""
    root, source = tmp_path / "data", tmp_path / "notes.txt"
    text = corpus_text()
    source.write_text(text[: len(text) // 2])
    prepare_text(root, "notes", source).check_returncode()
    run_dir = tmp_path / "run"
    args = with_data(tiny_args(root, run_dir, *STOP_ARGS), "notes")
    stopped_run(args, run_dir, tmp_path / "stopped.log")
    before = snapshot(run_dir)

    before_tokens = split_tokens(root / "notes")
    source.write_text(text[len(text) // 2:])  # edited text, the same settings
    prepared = prepare_text(root, "notes", source, "--force")
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    after_tokens = split_tokens(root / "notes")
    refused = run_dtrain(args)
    line = one_line_error(refused)
    assert "train split" in line and f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before, "the refused continuation trained or wrote"

    # on purpose: resume=PATH continues its checkpoint on the new data, and says so once
    (ckpt,) = list_checkpoints(run_dir / "checkpoints")
    resumed = run_dtrain([*args, f"resume={ckpt}"], check=True)
    assert max(train_losses(run_dir)) == STEPS
    said = [line for line in resumed.stderr.splitlines() if "was trained on other data" in line]
    was, now = before_tokens, after_tokens
    assert said == [f"dtrain: {ckpt} was trained on other data than dataset 'notes' in {root / 'notes'} holds now: "
                    f"train split: {was['train']:,} tokens in 1 shard then, {now['train']:,} in 1 shard now; "
                    f"val split: {was['val']:,} tokens in 1 shard then, {now['val']:,} in 1 shard now; continuing on "
                    "the new data, as resume= asks (the checkpoints it saves record the new data)"], resumed.stderr
    assert said[0].removeprefix("dtrain: ") in (run_dir / "dtrain.log").read_text()
    assert newest_resumable(run_dir / "checkpoints").state["data"]["train"]["tokens"] == after_tokens["train"]


@pytest.mark.slow
def test_prepare_force_under_a_live_run_is_refused(tmp_path):
    root, source = tmp_path / "data", tmp_path / "notes.txt"
    source.write_text(corpus_text()[:400_000])
    prepare_text(root, "notes", source).check_returncode()
    manifest = (root / "notes" / "manifest.json").read_bytes()
    run_dir, log = tmp_path / "run", tmp_path / "live.log"
    proc = start_dtrain(with_data(tiny_args(root, run_dir, "train.max_steps=100000"), "notes"), log)
    try:
        wait_for(lambda: logged(run_dir), proc, log)
        refused = prepare_text(root, "notes", source, "--force")
        line = one_line_error(refused)
        assert "in use by a running dtrain run" in line and f"pid {proc.pid}" in line, line
        assert (root / "notes" / "manifest.json").read_bytes() == manifest
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a dead run's lock goes with it
        proc.wait(timeout=60)
    again = prepare_text(root, "notes", source, "--force")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((root / "notes" / "manifest.json").read_text())["created"]


# --- what the checkpoint records: the run's keys, its batch, its data and tokenizer -----------------
def test_a_deleted_run_record_is_replaced_by_the_checkpoints_own(data_dir, references, tmp_path):
    """The run's resolved_config.json deleted: the newest checkpoint's config.json says what the
    run was (lr 6e-4, 8 steps), so another lr or max_steps is one line naming resume=, not a
    silent continuation."""
    run_dir = tmp_path / "run"
    copy_whole_run(references("none"), run_dir)
    (run_dir / CONFIG_RECORD).unlink()
    before = snapshot(run_dir)
    for change, named in [("optim.lr=1e-2", "optim.lr=0.0006 there vs 0.01"),
                          (RESUMED[0], "train.max_steps=8, not 9")]:
        line = one_line_error(run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, change)))
        assert named in line and f"resume={run_dir}" in line, line
        assert snapshot(run_dir) == before, f"{change}: the refused continuation wrote into the run directory"


def _truncated(state: Path) -> None:
    with state.open("r+b") as f:
        f.truncate(100)


def _garbled(state: Path) -> None:
    flip(state, state.stat().st_size // 2)


def _unverified_and_not_json(state: Path) -> None:
    """A checkpoint from before checksums (nothing to verify it by) whose state is no JSON."""
    marker = state.parent / MARKER
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k in ("step", "world")}
                                 | {"format": 1}))
    state.write_text('{"step": 8, "tok')


@pytest.mark.parametrize("damage", [_truncated, _garbled, _unverified_and_not_json])
def test_a_damaged_newest_record_is_checked_as_the_checkpoint_resume_loads(damage, data_dir, references,
                                                                          tmp_path):
    """The newest checkpoint's trainer state damaged, the command at world 2 (global batch 1,024, the
    run's 512): resume=auto would set it aside and load step 6, so step 6's record is checked and the
    batch change refused in one line; nothing is moved or rewritten."""
    run_dir = tmp_path / "run"
    ckpts = copy_whole_run(references("none"), run_dir)
    damage(ckpts / CKPT_NAMES[-1] / STATE_FILE)
    before = snapshot(run_dir)
    line = one_line_error(run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED, *DDP)))
    assert "train.total_batch_size=512" in line and f"resume={run_dir}" in line, line
    assert f"({CKPT_NAMES[1]}, the newest intact checkpoint" in line and f"corrupt: {CKPT_NAMES[-1]}" in line, line
    assert snapshot(run_dir) == before, "the refused continuation moved or wrote something"
    assert newest_resumable(ckpts).ckpt == ckpts / CKPT_NAMES[1]


def test_no_intact_checkpoint_left_is_refused_before_anything_is_written(data_dir, references, tmp_path):
    """Every checkpoint's trainer state damaged: no record to check a continuation against, and
    nothing resume could load; one line, nothing moved, the run's record not rewritten."""
    run_dir = tmp_path / "run"
    ckpts = copy_whole_run(references("none"), run_dir)
    for name in CKPT_NAMES:
        _truncated(ckpts / name / STATE_FILE)
    before = snapshot(run_dir)
    line = one_line_error(run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED, *DDP)))
    assert "no intact checkpoint is left" in line and "resume=PATH" in line, line
    assert snapshot(run_dir) == before


def test_another_tokenizer_under_the_same_ids_is_refused(data_dir, references, tmp_path):
    """The same shards under a manifest that names another tokenizer: the checkpoint records the
    session tokenizer's name, size, end-of-text id and file fingerprint (issue 36)."""
    root = tmp_path / "data"
    shutil.copytree(data_dir, root)
    data = ["model=tiny", "data=text", "data.name=corpus"]
    cfg = compose([*data, f"data.dir={root}", *tokenizer_args(root)])
    manifest = dataset_dir(as_data_cfg(cfg.data)) / "manifest.json"
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "tokenizer": "llama", "vocab_size": 128_256}))
    run_dir = tmp_path / "run"
    copy_whole_run(references("none"), run_dir)
    chosen = newest_resumable(run_dir / "checkpoints")
    tokenizer = load_tokenizer({"name": "hf", "path": str(data_dir / TOKENIZER_FOLDER)})
    assert chosen.state["tokenizer"] == identity_of(tokenizer) and tokenizer.vocab_size == SMALL_VOCAB
    with pytest.raises(DataError, match=f"tokenizer 'hf' then, 'llama' now; vocab_size {SMALL_VOCAB} then, 128256 now"):
        check_same_data(cfg, run_dir, chosen)
    check_same_data(compose([*data, f"data.dir={data_dir}", *tokenizer_args(data_dir)]), run_dir, chosen)


# --- a continued run's metrics: one summary, the continued run's ------------------------------------
def test_a_continued_run_keeps_one_summary_record(tmp_path):
    """A resume at step 10 of a finished 10-step run drops its summary with the steps after it: the
    continued run logs its own at its end, the only one, which the readers take as the run's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "tokens": 256 * s, "loss": 10.0 - s / 10} for s in range(1, 11)]
    lines.append({"step": 10, "tokens": 2560, "summary": {"final_loss": 9.0, "steps": 10, "tokens": 2560}})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / CONFIG_RECORD).write_text(json.dumps({"train": {"max_steps": 15}}))
    metrics = MetricsLogger(run_dir, True, resume_step=10)
    for s in range(11, 16):
        metrics.log({"step": s, "tokens": 256 * s, "loss": 10.0 - s / 10})
    metrics.log({"step": 15, "tokens": 3840, "summary": {"final_loss": 8.5, "steps": 15, "tokens": 3840}})
    metrics.close()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "summary" in r] == [15]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 16))
    finished, figures = run_figures(run_dir)
    assert finished and figures["steps"] == 15 and figures["final_loss"] == 8.5
    assert check_run_dir(run_dir, "auto", {"train": {"max_steps": 15}}) is RunDirState.FINISHED


@pytest.mark.slow
def test_resume_of_a_finished_run_with_more_steps_ends_with_one_summary(data_dir, references, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(references("none"), run_dir)
    run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED, f"resume={run_dir}"), check=True)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "summary" in r] == [9], [r for r in records if "summary" in r]
    assert sorted(train_losses(run_dir)) == list(range(1, 10))
    assert run_figures(run_dir)[0]
    again = run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *RESUMED))
    assert again.returncode == 0 and "already finished (step 9" in again.stdout, again.stdout[-2000:]


@pytest.mark.slow
def test_a_crashed_run_is_continued_only_on_the_terms_its_checkpoints_record(data_dir, tmp_path):
    """The issue's two cases on one run killed with kill -9 after its checkpoints: its record deleted,
    lr 1e-2 is refused; its newest trainer state truncated, world 2 is refused (the batch of the
    checkpoint resume falls back to); the same command then continues from that checkpoint with the
    run's own schedule, to one summary."""
    run_dir, log = tmp_path / "run", tmp_path / "crashed.log"
    args = tiny_args(data_dir, run_dir, "train.max_steps=20", "checkpoint.interval=3")
    proc = start_dtrain(args, log)
    try:
        wait_for(lambda: past_a_checkpoint(run_dir) and len(list_checkpoints(run_dir / "checkpoints")) >= 2,
                 proc, log)
    finally:
        kill_group(proc)
    crashed_lr = {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}
    newest = latest_checkpoint(run_dir)
    older = list_checkpoints(run_dir / "checkpoints")[-2]
    (run_dir / CONFIG_RECORD).unlink()
    before = snapshot(run_dir)

    line = one_line_error(run_dtrain([*args, "optim.lr=1e-2"]))
    assert "optim.lr=0.0006 there vs 0.01" in line and f"resume={run_dir}" in line, line
    assert snapshot(run_dir) == before

    _truncated(newest / STATE_FILE)
    before = snapshot(run_dir)
    line = one_line_error(run_dtrain([*args, *DDP]))
    assert "global batch of 256 tokens" in line and "train.total_batch_size=256" in line, line
    assert f"({older.name}, the newest intact checkpoint" in line, line
    assert snapshot(run_dir) == before

    resumed = run_dtrain(args, check=True)
    assert f"resuming from {older} (step" in resumed.stderr, resumed.stderr[-3000:]
    got_lr = {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}
    assert sorted(got_lr) == list(range(1, 21))
    assert all(got_lr[s] == crashed_lr[s] for s in crashed_lr), (got_lr, crashed_lr)
    assert [r["step"] for r in read_metrics(run_dir) if "summary" in r] == [20]


# --- a continuation that takes its sums in another order says so ------------------------------------
@pytest.mark.slow
def test_a_continuation_on_other_threads_says_it_is_not_bitwise(data_dir, references, tmp_path):
    """A crashed run continued with launch.threads_per_worker changed (issue 45: best val loss
    10.309918451 then 10.309918499, while the docs promised bitwise): one line, on stderr and in
    dtrain.log, naming the threads it was saved with and runs with now; the losses within 1e-5 of the
    uninterrupted run's. The same command with nothing changed: no such line, bitwise."""
    reference = references("none")
    saved = json.loads((reference / "checkpoints" / CKPT_NAMES[1] / STATE_FILE).read_text())
    threads = os.cpu_count() or 1  # launch.threads_per_worker=null: the cores, for one worker
    other = 1 if threads > 1 else 2
    want = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(reference) if "loss" in r}
    for name, extra in (("same", ()), ("other", (f"launch.threads_per_worker={other}",))):
        run_dir = tmp_path / name
        crashed_copy(reference, run_dir, 6)
        proc = run_dtrain(tiny_args(data_dir, run_dir, *CKPT_ARGS, *extra), check=True)
        said = [line for line in proc.stderr.splitlines() if "order of floating-point sums" in line]
        logged_lines = [line for line in (run_dir / "dtrain.log").read_text().splitlines()
                        if "order of floating-point sums" in line]
        got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}
        assert sorted(got) == sorted(want)
        if name == "same":
            assert not said and not logged_lines, said
            assert got == want
            continue
        assert said == [f"dtrain: continuing {CKPT_NAMES[1]} with launch.threads_per_worker {threads} then, {other} "
                        "now: that changes the order of floating-point sums, so the losses will not be bitwise those "
                        "of an uninterrupted run (on CPU in fp32 they stay within ~1e-5 of them: "
                        "docs/checkpoints.md#resume)"], proc.stderr[-3000:]
        assert len(logged_lines) == 1 and logged_lines[0].endswith(said[0].removeprefix("dtrain: ")), logged_lines
        assert max(abs(got[s][0] - want[s][0]) for s in got) < 1e-5, (got, want)
    assert saved["threads_per_worker"] == threads and saved["device"] == "cpu"  # what the checkpoint records
