"""Weighted mixtures of prepared datasets (issue 36 item 7): `data=mix data.mix='{a: 0.7, b: 0.3}'`.

In process, on the loader itself (each source's tokens marked by their range, so a row tells where
it came from): over 100 steps every source gets its weight's share within 1%, every world size,
accumulation and micro batch reads the same rows per step, a saved position continues exactly (at
another world size too), and a source read whole starts over with one `dtrain:` line. On the command
line: a source not prepared, bad weights and `dtrain prepare data=mix` are one line each before
anything is written; real runs (slow): none/ddp/zero/fsdp at world 2 within 1e-5 of each other, with
tokens_by_source in metrics.jsonl and the summary and validation per source; kill -9 and resume
bitwise, and resharded to one process; a changed weight refused naming `resume=`; a source prepared
again from other text refused by the checkpoint's data identity; sources of two tokenizers refused
naming both.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.checkpoints import crashed_copy, loss_records, snapshot
from helpers.dtrain import corpus_text, read_metrics, run_dtrain, tiny_args, train_losses
from helpers.errors import assert_user_error
from helpers.processes import kill_past_a_checkpoint
from helpers.runs import REFERENCE_BATCH, on_reference_steps
from helpers.tokenizers import byte_level_folder

from trainer.checkpoint.records import newest_resumable
from trainer.config.compose import compose
from trainer.config.keys import run_identity
from trainer.config.schema import to_dict
from trainer.data.mix_loader import MixtureLoader
from trainer.data.mixture import Schedule, mixed_figures, mixture_weights
from trainer.errors import ConfigError, DataError
from trainer.preflight.continuation import check_same_data
from trainer.preflight.rundir import trajectory_changes

SEQ = 16
B_OFFSET = 1000  # source b's ids are 1000 + position: a row's first id says its source


def synthetic_sources() -> dict[str, list[np.ndarray]]:
    """Source a: two shards (ids 0..999 by position, as uint16 like prepared shards); source b: one
    short shard (ids 1000..1699) that a 100-step run reads whole several times."""
    a = [(np.arange(n) % B_OFFSET).astype(np.uint16) for n in (5000, 3001)]
    b = [(B_OFFSET + np.arange(700)).astype(np.uint16)]
    return {"a": a, "b": b}


def loader(world: int, rank: int, accum: int, micro: int, weights=None) -> MixtureLoader:
    sources = synthetic_sources()
    return MixtureLoader(sources, weights or {"a": 0.7, "b": 0.3}, micro, SEQ, rank, world, accum, seed=5,
                         device=torch.device("cpu"), vocab_size=2000, redo={n: f"prepare {n}" for n in sources})


def read_steps(world: int, accum: int, micro: int, steps: int, loaders=None) -> list[np.ndarray]:
    """Every step's rows (inputs and last target) in global order: chunk m * world + r is rank r's m-th."""
    loaders = loaders or [loader(world, r, accum, micro) for r in range(world)]
    out = []
    for _ in range(steps):
        chunks = {}
        for m in range(accum):
            for r, each in enumerate(loaders):
                x, y = each.next_batch()
                assert x.shape == y.shape == (micro, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
                chunks[m * world + r] = torch.cat([x, y[:, -1:]], dim=1).numpy()
        out.append(np.concatenate([chunks[c] for c in sorted(chunks)]))
    return out


def test_each_source_gets_its_share_at_every_world_size(capsys):
    steps = read_steps(world=2, accum=2, micro=2, steps=100)
    rows = np.concatenate(steps)
    from_b = rows[:, 0] >= B_OFFSET
    assert len(rows) == 800 and abs(from_b.mean() - 0.3) <= 0.01 and abs((~from_b).mean() - 0.7) <= 0.01
    # a row is seq_len + 1 consecutive ids of one source (ids by position: a run of +1 steps, mod 1000)
    assert all(((np.diff(row.astype(int)) % B_OFFSET) == 1).all() for row in rows)
    assert all(((row >= B_OFFSET) == (row[0] >= B_OFFSET)).all() for row in rows)
    # every step holds each source's share to within one sequence
    assert all(abs((s[:, 0] >= B_OFFSET).sum() - 0.3 * 8) < 1 for s in steps)
    # one line each time a source starts over: b (700 ids, 43 rows of 16 + 1 per pass) after 43, 86, ...
    # of its 240 rows, a (2 shards, 312 + 187 rows per pass) after 499 of its 560
    said = [line for line in capsys.readouterr().err.splitlines() if "starts over" in line]
    assert [line.split("'")[2] for line in said] == ["b", "b", "b", "b", "a", "b"], said
    assert said[0] == ("dtrain: data.mix's source 'b' was read whole (700 tokens of its train split): it starts "
                       "over at step 19 (epoch 2 of it)")
    for world, accum, micro in [(1, 4, 2), (4, 1, 2), (2, 1, 4), (1, 1, 8)]:
        other = read_steps(world, accum, micro, steps=100)
        assert all(np.array_equal(a, b) for a, b in zip(steps, other)), (world, accum, micro)
    counts = loader(1, 0, 1, 8)
    for _ in range(100):
        counts.next_batch()
    assert counts.tokens_by_source() == {"a": int((~from_b).sum()) * SEQ, "b": int(from_b.sum()) * SEQ}


def test_a_mixture_of_one_source_reads_it_in_order():
    (one,) = read_steps(world=1, accum=1, micro=8, steps=1, loaders=[loader(1, 0, 1, 8, weights={"a": 1.0})])
    assert np.array_equal(one[:, 0], np.arange(8) * SEQ)  # a's first shard, sequence after sequence


def test_a_saved_position_continues_exactly_at_another_world_size():
    uninterrupted = read_steps(world=2, accum=1, micro=4, steps=60)
    first = [loader(2, r, 1, 4) for r in range(2)]
    read_steps(2, 1, 4, steps=37, loaders=first)
    states = [json.loads(json.dumps(each.state_dict())) for each in first]  # as a checkpoint stores it
    assert states[0] == states[1]
    resumed = [loader(1, 0, 2, 4)]
    resumed[0].load_state_dict(states[0])
    assert all(np.array_equal(a, b) for a, b in zip(uninterrupted[37:], read_steps(1, 2, 4, 23, loaders=resumed)))


def test_the_schedule_and_the_figures():
    schedule = Schedule({"a": 0.5, "b": 0.25, "c": 0.25})
    picks = [schedule.names[schedule.next()] for _ in range(8)]
    assert picks == ["a", "b", "c", "a"] * 2  # smooth: a never twice in a row, ties go by name
    # each source's [nats over every target, nats over the targets with bytes, bytes, targets]
    figures = mixed_figures({"a": [40.0, 10.0, 40.0, 20.0], "b": [40.0, 30.0, 10.0, 10.0]}, {"a": 0.75, "b": 0.25})
    assert (figures["val_loss/a"], figures["val_loss/b"]) == (2.0, 4.0)  # nats per token
    assert figures["val_loss"] == 0.75 * 2 + 0.25 * 4
    assert figures["val_bpb/a"] == pytest.approx(10 / (math.log(2) * 40))
    # weighted bits per token over weighted bytes per token
    assert figures["val_bpb"] == pytest.approx((0.75 * 10 / 20 + 0.25 * 30 / 10) / math.log(2)
                                               / (0.75 * 40 / 20 + 0.25 * 10 / 10))


def test_weights_are_normalised_and_checked():
    weights = mixture_weights(compose(["data=mix", "data.mix={b: 1, a: 3}"]).data)  # as Hydra parses it
    assert weights == {"a": 0.75, "b": 0.25} and list(weights) == ["a", "b"]
    assert mixture_weights({"name": "text", "mix": None}) is None
    for mix, needle in [({"a": 0.7, "b": -0.3}, "'b' the weight -0.3"), ({"a": 0.7, "b": "x"}, "'b' the weight 'x'"),
                        ({"a": 0.7, "b": True}, "'b' the weight True"), (3, "data.mix=3 is not a mapping"),
                        ({"a": math.inf}, "'a' the weight inf"), ({"..": 1}, "not a dataset's folder name"),
                        ({}, "data=mix needs its sources: data.mix='{")]:
        with pytest.raises(ConfigError, match="data.mix") as err:
            mixture_weights({"name": "mix", "mix": mix})
        assert needle in str(err.value), err.value


def test_weights_in_one_proportion_are_one_setting_and_one_run_folder():
    """Compared and named after normalizing, as the loader reads them (issue 45: {a: 7, b: 3} was
    refused as a changed setting of a {a: 0.7, b: 0.3} run); {0.3, 0.3, 0.3} and {1, 1, 1} give the
    same floats too, which plain division does not (0.33333333333333337)."""
    def job(mix: str) -> dict:
        return to_dict(compose(["data=mix", f"data.mix={mix}"]))

    for written, same in [("{a: 7, b: 3}", "{a: 0.7, b: 0.3}"), ("{a: 0.3, b: 0.3, c: 0.3}", "{a: 1, b: 1, c: 1}")]:
        assert trajectory_changes(job(same), job(written)) == []
        assert run_identity(job(same)) == run_identity(job(written))
        assert mixture_weights(job(same)["data"]) == mixture_weights(job(written)["data"])
    assert trajectory_changes(job("{a: 0.7, b: 0.3}"), job("{a: 0.6, b: 0.4}")) == ["data.mix.a", "data.mix.b"]
    assert run_identity(job("{a: 0.7, b: 0.3}")) != run_identity(job("{a: 0.6, b: 0.4}"))


def test_a_source_not_prepared_is_one_line(data_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_dtrain(["train", "model=tiny", "data=mix", "data.mix={corpus: 0.7, my_code: 0.3}",
                       f"data.dir={data_dir}", f"hydra.run.dir={run_dir}"])
    # nothing records my_code's text: the line says data.source is needed, with no command that would fail
    assert_user_error(proc, "data.mix's source 'my_code' is not prepared", "nothing records the text of 'my_code'",
                      "data=text data.name=my_code data.source=FILES")
    assert "`" not in proc.stderr
    assert not run_dir.exists()
    assert_user_error(run_dtrain(["prepare", "data=mix", "data.mix={corpus: 1}"]), "prepare each of its sources")


# --- real runs (slow) -----------------------------------------------------------------------------------
MIX = ("data=mix", "data.mix={a: 0.7, b: 0.3}")


@pytest.fixture(scope="module")
def mix_dir(module_tmp) -> Path:
    """Two sources prepared from local text: a (about 30k tokens), b (a short other text, about 1,500
    tokens, half of it validation, so that its train split is read whole within 10 steps)."""
    root = module_tmp.mktemp("mix")
    text = corpus_text()
    (root / "a.txt").write_text(text[:120_000])
    (root / "b.txt").write_text(text[-3_500:].upper())
    for name, fraction in (("a", "0.1"), ("b", "0.5")):
        run_dtrain(["prepare", "data=text", f"data.name={name}", f"data.source={root / f'{name}.txt'}",
                    f"data.dir={root}", f"data.val_fraction={fraction}"], check=True)
    return root


def mix_args(mix_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    args = tiny_args(mix_dir, run_dir, *MIX, *extra)
    return [a for a in args if a not in ("data=text", "data.name=corpus")]


# The 256-token reference steps, 12 of them, with a checkpoint every 3 steps (3, 6, 9, 12; 6, 9 and 12
# kept): each mode's uninterrupted run is both a parity run and the reference its kill -9 and resume
# is compared with.
STEPS = 12
CHECKPOINTED = (*(a for a in REFERENCE_BATCH if not a.startswith("train.max_steps=")), f"train.max_steps={STEPS}",
                "checkpoint.interval=3")


def checkpointed_args(mix_dir: Path, run_dir: Path, mode: str) -> list[str]:
    return mix_args(mix_dir, run_dir, *CHECKPOINTED, *on_reference_steps(mode))


@pytest.fixture(scope="module")
def mix_runs(mix_dir, module_tmp):
    """mode -> (run dir, stderr) of its uninterrupted checkpointed mixture run, trained once per
    module. Read-only: a test that continues a run makes its own."""
    root, made = module_tmp.mktemp("mix_runs"), {}

    def get(mode: str) -> tuple[Path, str]:
        if mode not in made:
            run_dir = root / mode
            made[mode] = run_dir, run_dtrain(checkpointed_args(mix_dir, run_dir, mode), check=True).stderr
        return made[mode]

    return get


@pytest.mark.slow
def test_a_source_too_small_for_one_validation_sequence_is_one_line(mix_dir, tmp_path):
    """The sources' val splits (a few thousand tokens) cannot hold one validation sequence of 4,096
    tokens: one line naming the first such source and the fix, before anything is written."""
    run_dir = tmp_path / "run"
    proc = run_dtrain(mix_args(mix_dir, run_dir, "train.micro_batch_size=1", "train.seq_len=4096",
                               "model.block_size=4096", "train.val_tokens=4096"))
    assert_user_error(proc, "the val split of data.mix's source 'a' holds at most",
                      "one validation sequence needs 4,097 (seq_len, +1)", "train.val_tokens=0")
    assert not run_dir.exists()


@pytest.mark.slow
def test_every_mode_reads_the_same_mixture(mix_runs):
    """none, ddp, zero and fsdp at world 2 on 256-token steps of the mixture: losses within 1e-5 of
    the one process's; validation per source and overall (the sources' at their weights); tokens by
    source in every step record and the summary, at the weights' shares."""
    runs = {mode: mix_runs(mode)[0] for mode in ("none", "ddp", "zero", "fsdp")}
    want = train_losses(runs["none"])
    assert sorted(want) == list(range(1, STEPS + 1))
    for mode in ("ddp", "zero", "fsdp"):
        got = train_losses(runs[mode])
        assert max(abs(got[s] - want[s]) for s in want) < 1e-5, mode
    vals = {}
    for mode, run_dir in runs.items():  # each source's validation set: the same tokens in every mode
        (val,) = vals[mode] = [r for r in read_metrics(run_dir) if "val_loss" in r]
        assert set(val) >= {"val_loss", "val_bpb", "val_loss/a", "val_bpb/a", "val_loss/b", "val_bpb/b"}, val
        assert abs(val["val_loss"] - (0.7 * val["val_loss/a"] + 0.3 * val["val_loss/b"])) < 1e-6, (mode, val)
        assert min(val["val_bpb/a"], val["val_bpb/b"]) < val["val_bpb"] < max(val["val_bpb/a"], val["val_bpb/b"])
        # weights that track the one process's to rounding score what it scores, to rounding
        assert all(abs(val[key] - vals["none"][0][key]) < 1e-5 for key in val if key.startswith("val_")), (mode, val)
    records = read_metrics(runs["none"])
    (summary,) = [r["summary"] for r in records if "summary" in r]
    by_source = summary["tokens_by_source"]
    assert sum(by_source.values()) == summary["tokens"] == STEPS * 256
    assert abs(by_source["a"] / summary["tokens"] - 0.7) <= 0.01, by_source
    steps = [r for r in records if "loss" in r]
    assert all(sum(r["tokens_by_source"].values()) == r["tokens"] for r in steps)


@pytest.mark.slow
def test_kill_and_resume_a_mixture_bitwise(mix_dir, mix_runs, tmp_path):
    """kill -9 after a checkpoint, the same command resumes: every loss, grad norm and tokens by
    source equal the uninterrupted run's (source b is read whole and starts over on the way); a
    changed weight is refused naming resume=, nothing written; a checkpoint resumed by one process
    tracks the world-2 run within 1e-5; the checkpoint's data identity covers each source."""
    reference, done = mix_runs("ddp")
    assert "data.mix's source 'b' was read whole" in done, done[-3000:]
    run_dir = tmp_path / "run"
    args = checkpointed_args(mix_dir, run_dir, "ddp")
    assert kill_past_a_checkpoint(args, run_dir, tmp_path / "killed.log") < STEPS
    before = snapshot(run_dir)
    changed = run_dtrain([*args, "data.mix.b=0.4"])
    assert_user_error(changed, "data.mix.b", f"resume={run_dir}")
    assert snapshot(run_dir) == before
    resumed = run_dtrain(args, check=True)
    assert f"resuming from {run_dir / 'checkpoints'}/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert loss_records(run_dir) == loss_records(reference)
    by_source = {r["step"]: r["tokens_by_source"] for r in read_metrics(run_dir) if "loss" in r}
    assert by_source == {r["step"]: r["tokens_by_source"] for r in read_metrics(reference) if "loss" in r}
    # resharded: its step-9 checkpoint (of 6, 9, 12 kept) continued by one process (accumulation 2): the same tokens
    resharded = tmp_path / "resharded"
    run_dtrain(mix_args(mix_dir, resharded, *CHECKPOINTED, "parallel=none", "train.micro_batch_size=4",
                        f"resume={reference / 'checkpoints' / 'step_000009'}"), check=True)
    want, got = train_losses(reference), train_losses(resharded)
    assert sorted(got) == list(range(10, STEPS + 1)), got
    assert max(abs(got[s] - want[s]) for s in got) < 1e-5, (got, want)
    assert all(r["tokens_by_source"] == by_source[r["step"]] for r in read_metrics(resharded) if "loss" in r)
    # the checkpoint records each source's identity: b prepared again from other text is refused
    chosen, data = newest_resumable(run_dir / "checkpoints"), tmp_path / "data"
    assert sorted(chosen.state["data"]) == ["a/train", "a/val", "b/train", "b/val"]
    check_same_data(compose(mix_args(mix_dir, run_dir)[1:]), run_dir, chosen)
    shutil.copytree(mix_dir, data)
    (data / "b.txt").write_text(corpus_text()[:5_000].upper())
    run_dtrain(["prepare", "data=text", "data.name=b", f"data.source={data / 'b.txt'}", f"data.dir={data}",
                "data.val_fraction=0.5", "--force"], check=True)
    with pytest.raises(DataError, match="data.mix's datasets 'a', 'b' in .* is not the data .*b/train split"):
        check_same_data(compose(mix_args(data, run_dir)[1:]), run_dir, chosen)


@pytest.mark.slow
def test_a_crashed_mixture_continues_with_its_weights_written_otherwise(mix_dir, mix_runs, tmp_path):
    """A {a: 0.7, b: 0.3} run crashed after its step-9 checkpoint: the command with {a: 7, b: 3}
    continues it and ends bitwise as the uninterrupted run (issue 45: refused as a changed setting);
    {a: 0.6, b: 0.4} is still one line naming resume=, nothing written."""
    reference, _ = mix_runs("none")
    run_dir = tmp_path / "run"
    crashed_copy(reference, run_dir, STEPS - 3)
    args = checkpointed_args(mix_dir, run_dir, "none")
    before = snapshot(run_dir)
    assert_user_error(run_dtrain(retyped(args, "{a: 0.6, b: 0.4}")), "data.mix.a=0.7 there vs 0.6", f"resume={run_dir}")
    assert snapshot(run_dir) == before
    resumed = run_dtrain(retyped(args, "{a: 7, b: 3}"), check=True)
    assert f"resuming from {run_dir / 'checkpoints'}/step_{STEPS - 3:06d}" in resumed.stderr, resumed.stderr
    assert loss_records(run_dir) == loss_records(reference)
    by_source = [r["tokens_by_source"] for r in read_metrics(run_dir) if "loss" in r]
    assert by_source == [r["tokens_by_source"] for r in read_metrics(reference) if "loss" in r]


def retyped(args: list[str], mix: str) -> list[str]:
    return [f"data.mix={mix}" if a.startswith("data.mix=") else a for a in args]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_kill_and_resume_a_mixture_bitwise_with_sharded_state(mode, mix_dir, mix_runs, tmp_path):
    """The same kill -9 and resume where the optimizer state (zero) or the parameters too (fsdp)
    are sharded: every loss and grad norm and the tokens by source equal the uninterrupted run's."""
    reference, _ = mix_runs(mode)
    run_dir = tmp_path / "run"
    args = checkpointed_args(mix_dir, run_dir, mode)
    assert kill_past_a_checkpoint(args, run_dir, tmp_path / "killed.log") < STEPS
    resumed = run_dtrain(args, check=True)
    assert f"resuming from {run_dir / 'checkpoints'}/step_" in resumed.stderr, resumed.stderr[-3000:]
    assert loss_records(run_dir) == loss_records(reference)
    by_source = {r["step"]: r["tokens_by_source"] for r in read_metrics(run_dir) if "loss" in r}
    assert by_source == {r["step"]: r["tokens_by_source"] for r in read_metrics(reference) if "loss" in r}


@pytest.mark.slow
def test_sources_of_two_tokenizers_are_one_line(mix_dir, tmp_path):
    """Source c prepared with its own byte-level tokenizer beside a (GPT-2's): one line naming both."""
    data = tmp_path / "data"
    shutil.copytree(mix_dir / "a", data / "a")
    folder = byte_level_folder(tmp_path / "tok", [corpus_text()[:50_000]], 400)
    run_dtrain(["prepare", "data=text", "data.name=c", f"data.source={mix_dir / 'b.txt'}", f"data.dir={data}",
                "tokenizer=hf", f"tokenizer.path={folder}"], check=True)
    run_dir = tmp_path / "run"
    proc = run_dtrain(["train", "model=tiny", "data=mix", "data.mix={a: 0.5, c: 0.5}", f"data.dir={data}",
                       f"hydra.run.dir={run_dir}"])
    assert_user_error(proc, "data.mix's sources 'a' and 'c' were prepared with different tokenizers",
                      "tokenizer 'gpt2' with 50,257 ids", "tokenizer 'hf' with 400 ids")
    assert not run_dir.exists()
