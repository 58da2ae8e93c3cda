"""A run carries its tokenizer (issue 45, finding 2), `dtrain tokenizer train`'s refusals and
notices (finding 14, and its fit on the train split only: finding 3's last line), and a prompt that is
not UTF-8 (finding 13), caused as the user did: a tokenizer trained by `dtrain tokenizer train` on a
tiny corpus, a run trained with it, then its folder trained again with another vocabulary and moved
away; `sample`, `export` and the continuation go on with the run's own tokenizer, the checkpoint's copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.dtrain import TINYSHAKESPEARE, corpus_text, run_dtrain, train_losses
from helpers.errors import assert_user_error
from helpers.evals import offline_env, write_jsonl, write_tasks

from trainer.checkpoint.integrity import checksum_file
from trainer.checkpoint.layout import MARKER, STEP_PREFIX, latest_checkpoint
from trainer.config.compose import compose
from trainer.config.vocab import CHECKPOINT_MARKER, CHECKPOINT_PREFIX, tokenizer_folder
from trainer.data.layout import dataset_dir
from trainer.evals.hellaswag import Example
from trainer.prepare.pipeline import prepare
from trainer.prepare.tokenizer_training import fit_train_split
from trainer.tokenizers.load import load_tokenizer

pytest.importorskip("tokenizers")
VOCAB, OTHER_VOCAB = 400, 300
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def corpus(chars: int = 40_000) -> str:
    text = TINYSHAKESPEARE.read_text() if TINYSHAKESPEARE.exists() else corpus_text()
    return text[:chars]


def data_args(root: Path, name: str = "c", source: Path | None = None) -> list[str]:
    return ["data=text", f"data.name={name}", f"data.source={source or root / 'corpus.txt'}",
            f"data.dir={root / 'data'}"]


def train_tokenizer(root: Path, vocab: int, folder: Path, *extra: str, source: Path | None = None):
    return run_dtrain(["tokenizer", "train", *data_args(root, source=source), f"tokenizer.vocab_size={vocab}",
                       f"tokenizer.path={folder}", *extra])


def run_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """A tiny tokenizer=hf run of 6 steps that meets its target at its first validation (step 3) and
    stops there, checkpointed: train.continue_after_target=true continues the same run (resume=auto)."""
    return ["train", *data_args(root), "tokenizer=hf", f"tokenizer.path={root / 'tok'}", "model=tiny",
            "train.max_steps=6", "train.micro_batch_size=4", "train.seq_len=64", "train.val_batches=1",
            "train.log_interval=1",
            "train.val_interval=3", "train.target_val_loss=100", "train.sample_tokens=0", "train.progress=false",
            "data.auto_prepare=true", f"hydra.run.dir={run_dir}", *extra]


def sample(run_dir: Path, *extra: str):
    return run_dtrain(["sample", str(run_dir), "prompt=ROMEO: ", "tokens=12", "temperature=0", "device=cpu",
                       *extra])


@pytest.fixture(scope="module")
def trained(module_tmp):
    """(root, run dir, the run's greedy sample): a tokenizer of VOCAB ids trained by `dtrain tokenizer
    train` in root/tok (a copy of it in root/tok_original), a tiny run trained with it to step 3."""
    root = module_tmp.mktemp("carries")
    (root / "corpus.txt").write_text(corpus())
    train_tokenizer(root, VOCAB, root / "tok").check_returncode()
    shutil.copytree(root / "tok", root / "tok_original")
    run_dir = root / "run"
    run_dtrain(run_args(root, run_dir), check=True)
    return root, run_dir, sample(run_dir).stdout


def copy_run(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


@pytest.mark.slow
def test_a_run_carries_its_tokenizer(trained, tmp_path):
    """The user's story: `dtrain tokenizer train` into the folder the run names, with another
    vocabulary (--force), then the folder moved away: sample and export still read the run's own
    tokenizer (the checkpoint's copy), the export pairs the model's vocabulary with that tokenizer, and
    the same training command continues the run with it, losses equal to an uninterrupted run's."""
    transformers = pytest.importorskip("transformers")
    root, trained_dir, before = trained
    run_dir = copy_run(trained_dir, tmp_path / "run")  # the other tests read the trained run as it is
    ckpt = latest_checkpoint(run_dir)
    assert [(ckpt / name).read_bytes() for name in TOKENIZER_FILES] == \
        [(root / "tok_original" / name).read_bytes() for name in TOKENIZER_FILES]
    original = load_tokenizer({"name": "hf", "path": str(root / "tok_original")})
    reference = tmp_path / "reference"  # the same run, uninterrupted, with the original tokenizer folder
    run_dtrain([*run_args(root, reference), "train.continue_after_target=true"], check=True)
    scores = evaluations(run_dir, tmp_path)

    assert train_tokenizer(root, OTHER_VOCAB, root / "tok", "--force").returncode == 0
    assert load_tokenizer({"name": "hf", "path": str(root / "tok")}).vocab_size == OTHER_VOCAB
    for moved in (False, True):
        if moved:
            (root / "tok").rename(root / "tok_elsewhere")
            assert evaluations(run_dir, tmp_path) == scores
        assert sample(run_dir).stdout == before
        out = tmp_path / f"export_{moved}"
        run_dtrain(["export", str(run_dir), f"--out={out}"], check=True)
        exported = json.loads((out / "tokenizer.json").read_text())
        assert len(exported["model"]["vocab"]) == json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB
        hf = transformers.AutoTokenizer.from_pretrained(out)
        text = "ROMEO: what light through yonder window breaks?"
        assert len(hf) == VOCAB and hf(text, add_special_tokens=False).input_ids == list(original.encode(text))

    # the very same command continues it (resume=auto), on the run's own tokenizer and data
    again = run_dtrain([*run_args(root, run_dir), "train.continue_after_target=true"], check=True)
    assert f"continuing the run in {run_dir}" in again.stderr
    assert f"tokenizer.path={root / 'tok'} holds no tokenizer now; the run continues with its own" in again.stderr
    assert "resumed at step 3" in again.stdout
    got, want = train_losses(run_dir), train_losses(reference)
    assert sorted(got) == list(range(1, 7)) and got == want
    assert (latest_checkpoint(run_dir) / "tokenizer.json").read_bytes() == (root / "tok_original" /
                                                                           "tokenizer.json").read_bytes()
    record = json.loads((run_dir / "resolved_config.json").read_text())
    assert record["tokenizer"]["path"] == str(root / "tok") and record["tokenizer"]["checkpoint"] is None
    (root / "tok_elsewhere").rename(root / "tok")


def evaluations(run_dir: Path, tmp_path: Path) -> tuple:
    """`dtrain eval`'s HellaSwag figures and `--tasks`' (a local multiple-choice task, offline) of the
    run's checkpoint: each encodes its text with the run's tokenizer."""
    lines = [line for line in corpus().splitlines() if len(line.split()) >= 4]
    examples = [Example(lines[i] + "\n", tuple(lines[i + 1 + k * 7] for k in range(4)), i % 4)
                for i in range(0, 80, 10)]
    hellaswag = write_jsonl(tmp_path / "hellaswag.jsonl", examples)
    run_dtrain(["eval", str(run_dir), f"eval.hellaswag.path={hellaswag}", "world=1"], check=True)
    figures = json.loads((run_dir / "eval_hellaswag.json").read_text())
    tasks = tmp_path / "tasks"
    if not tasks.is_dir():
        tasks.mkdir()
        write_tasks(tasks)
    run_dtrain(["eval", str(run_dir), "--tasks", "dtrain_mc", "--include-path", str(tasks), "--device", "cpu",
                "--bootstrap-iters", "0"], env=offline_env(), check=True)
    harness = json.loads((run_dir / "eval_harness.json").read_text())["results"]
    return ({k: v for k, v in figures.items() if k.startswith("hellaswag_")}, harness)


def test_a_pinned_checkpoint_removed_by_retention_gives_way_to_the_newest_copy(tmp_path):
    """tokenizer.checkpoint names the checkpoint a continuation read; once retention removes it (a
    restarted attempt reads the config again), the newest complete checkpoint beside it with a copy
    stands in: a run's checkpoints hold its one tokenizer. The names it looks for are layout.py's."""
    assert (CHECKPOINT_MARKER, CHECKPOINT_PREFIX) == (MARKER, STEP_PREFIX)
    root = tmp_path / "checkpoints"
    for step, marked, copy in ((3, True, True), (9, True, True), (12, False, True), (15, True, False)):
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        if marked:
            (folder / MARKER).write_text("{}")
        if copy:
            (folder / "tokenizer.json").write_text("{}")
    assert tokenizer_folder("/x/tok", str(root / "step_000003")) == str(root / "step_000003")
    assert tokenizer_folder("/x/tok", str(root / "step_000006")) == str(root / "step_000009")
    assert tokenizer_folder("/x/tok", None) == "/x/tok"


def test_a_flipped_byte_in_the_tokenizer_copy_is_caught(trained, tmp_path):
    root, run_dir, _ = trained
    run = copy_run(run_dir, tmp_path / "run")
    copy = latest_checkpoint(run) / "tokenizer.json"
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    for argv in (["sample", str(run), "tokens=4", "device=cpu"], ["export", str(run), f"--out={tmp_path / 'hf'}"]):
        proc = run_dtrain(argv)
        assert_user_error(proc, f"checkpoint {copy.parent} is corrupt (tokenizer.json: xxh3_128 mismatch")
        assert "no intact checkpoint is left" in proc.stderr
    assert not (tmp_path / "hf").exists()


def as_saved_before_copies(ckpt: Path, tokenizer_path: Path) -> None:
    """Make `ckpt` a checkpoint as a dtrain before tokenizer copies saved it: no copy, its config's
    tokenizer.path naming `tokenizer_path`, its marker's checksums those of the files left."""
    for name in TOKENIZER_FILES:
        (ckpt / name).unlink()
    config = json.loads((ckpt / "config.json").read_text())
    config["tokenizer"]["path"] = config["data"]["tokenizer"]["path"] = str(tokenizer_path)
    (ckpt / "config.json").write_text(json.dumps(config))
    marker = json.loads((ckpt / MARKER).read_text())
    for name in TOKENIZER_FILES:
        del marker["files"][name], marker["bytes"][name]
    marker["files"]["config.json"] = checksum_file(ckpt / "config.json")
    marker["bytes"]["config.json"] = (ckpt / "config.json").stat().st_size
    (ckpt / MARKER).write_text(json.dumps(marker))


def test_a_checkpoint_without_a_copy_reads_a_matching_folder_or_says_which(trained, tmp_path):
    """A checkpoint saved before copies: tokenizer.path when it still holds the recorded tokenizer,
    else one line; --tokenizer DIR points at the folder, checked against the recorded fingerprint."""
    root, run_dir, before = trained
    run = copy_run(run_dir, tmp_path / "run")
    folder = shutil.copytree(root / "tok_original", tmp_path / "tok")
    as_saved_before_copies(latest_checkpoint(run), folder)
    assert sample(run).stdout == before  # the folder still holds it
    train_tokenizer(root, OTHER_VOCAB, folder, "--force").check_returncode()
    proc = sample(run)
    assert_user_error(proc, f"tokenizer.path={folder} is not the tokenizer checkpoint {latest_checkpoint(run)} "
                            f"was trained with (it holds no copy: saved before checkpoints kept one): vocab_size "
                            f"{VOCAB} then, {OTHER_VOCAB} now")
    assert "pass --tokenizer DIR, a folder holding the tokenizer it was trained with (tokenizer 'hf' with 400 ids" \
        in proc.stderr
    assert sample(run, f"--tokenizer={root / 'tok_original'}").stdout == before
    assert_user_error(sample(run, f"--tokenizer={folder}"), f"--tokenizer {folder} is not the tokenizer checkpoint")
    shutil.rmtree(folder)
    assert_user_error(sample(run), f"checkpoint {latest_checkpoint(run)} holds no copy of its tokenizer")
    out = tmp_path / "hf"
    run_dtrain(["export", str(run), f"--out={out}", f"--tokenizer={root / 'tok_original'}"], check=True)
    assert (out / "tokenizer.json").read_bytes() == (root / "tok_original" / "tokenizer.json").read_bytes()


def test_a_prompt_that_is_not_utf8_is_one_line(trained):
    _, run_dir, _ = trained
    proc = sample(run_dir, "--prompt=ROMEO \udcff\udcfe")  # what Python makes of argv bytes ff fe (PEP 383)
    assert_user_error(proc, "dtrain sample: argument --prompt: not UTF-8 text (byte 0xff at character 7)")


# --- dtrain tokenizer train ----------------------------------------------------------------------


def test_tokenizer_train_refuses_a_folder_with_a_tokenizer_without_force(tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus(20_000))
    folder = tmp_path / "tok"
    assert train_tokenizer(tmp_path, 300, folder).returncode == 0
    first = (folder / "tokenizer.json").read_bytes()
    assert_user_error(train_tokenizer(tmp_path, 280, folder),
                      f"tokenizer.path={folder} already holds a tokenizer (tokenizer.json, tokenizer_config.json); "
                      "add --force to replace it")
    assert (folder / "tokenizer.json").read_bytes() == first
    (folder / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')  # a model folder's, now stale
    assert train_tokenizer(tmp_path, 280, folder, "--force").returncode == 0
    assert load_tokenizer({"name": "hf", "path": str(folder)}).vocab_size == 280
    assert not (folder / "special_tokens_map.json").exists()


@pytest.mark.parametrize("text", ["", "a"], ids=["empty", "one-character"])
def test_tokenizer_train_refuses_a_corpus_without_text(tmp_path, text):
    """An empty corpus is refused as `dtrain prepare` refuses it, and one whose train split would hold
    no text (its one character is the validation split); nothing is written."""
    source = tmp_path / "empty.txt"
    source.write_text(text)
    proc = train_tokenizer(tmp_path, 300, tmp_path / "tok", source=source)
    if text:
        assert_user_error(proc, "the train split of dataset 'c' would hold no text to train a tokenizer on")
    else:
        assert_user_error(proc, f"dataset 'c' has no text (source {source}: 1 empty document(s)); check data.source")
        assert_user_error(run_dtrain(["prepare", *data_args(tmp_path, source=source)]), "dataset 'c' has no text")
    assert not (tmp_path / "tok").exists()


def test_tokenizer_train_says_when_the_vocabulary_is_smaller_than_asked(tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus(20_000))
    proc = train_tokenizer(tmp_path, 1_000_000, tmp_path / "tok")
    reached = load_tokenizer({"name": "hf", "path": str(tmp_path / "tok")}).vocab_size
    assert proc.returncode == 0 and reached < 10_000
    notices = [line for line in proc.stderr.splitlines() if line.startswith("dtrain: ")]
    assert notices == [f"dtrain: tokenizer.vocab_size=1,000,000 asked, but the train split of 'c' yields "
                       f"{reached:,} tokens: the 256 bytes, <|endoftext|> and every merge its text has; more text "
                       "gives more"], proc.stderr


def test_tokenizer_train_never_sees_the_validation_text(tmp_path):
    """The last few percent of the corpus is a word found nowhere else, inside what `dtrain prepare`
    will make the validation split: the trained vocabulary has no merge of it (trained on the whole
    text, BPE merges it first), and the split prepare writes with the tokenizer holds that text."""
    text = corpus(30_000)
    tail = "qxzv " * 100  # 500 bytes, under 2% of the text: inside the 5% validation split
    (tmp_path / "corpus.txt").write_text(text + tail)
    proc = train_tokenizer(tmp_path, 400, tmp_path / "tok")
    assert proc.returncode == 0, proc.stderr
    vocab = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not [token for token in vocab if "qx" in token or "zv" in token]
    run_dtrain(["prepare", *data_args(tmp_path), "tokenizer=hf", f"tokenizer.path={tmp_path / 'tok'}"], check=True)
    assert tail in val_text(compose([*data_args(tmp_path), "tokenizer=hf", f"tokenizer.path={tmp_path / 'tok'}"]))


def val_text(cfg) -> str:
    """The text of the validation split `dtrain prepare` wrote for `cfg`."""
    root = dataset_dir(cfg.data)
    manifest = json.loads((root / "manifest.json").read_text())
    ids = np.concatenate([np.fromfile(root / e["file"], dtype=manifest["dtype"]) for e in manifest["splits"]["val"]])
    tok = load_tokenizer(cfg.tokenizer)
    return tok.decode([i for i in ids if i != tok.eot])


@pytest.mark.parametrize("max_tokens", [None, 5000])
def test_the_fit_holds_out_exactly_the_validation_text(tmp_path, max_tokens):
    """The text the tokenizer was fitted on ends where the validation split that prepare writes with
    it starts, or before: several documents, data.max_tokens cutting the stream or not."""
    text = corpus(24_000)
    docs = [text[:9_000], "", text[9_000:15_000], text[15_000:]]
    for i, doc in enumerate(docs):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"{i}.txt").write_text(doc)
    fit = fit_train_split(docs, 350, 0.1, max_tokens, "dataset 'c'")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(fit.tokenizer.to_str())
    cfg = compose([*data_args(tmp_path, source=tmp_path / "src"), "data.val_fraction=0.1", "tokenizer=hf",
                   f"tokenizer.path={tmp_path / 'tok'}", *([f"data.max_tokens={max_tokens}"] if max_tokens else [])])
    prepare(cfg.data)
    held_out = val_text(cfg)
    k, offset = fit.cut
    trained_on = "".join(docs[:k]) + docs[k][:offset] if k < len(docs) else "".join(docs)
    whole = "".join(docs)
    assert held_out and whole.find(held_out, len(trained_on) - 4) >= len(trained_on)  # 4: a split UTF-8 char
    assert fit.train_bytes == len(trained_on.encode())
