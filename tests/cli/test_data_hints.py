"""The data's "run this" hints run as printed (issue 45 finding 16, item 10): each is caused for real,
its backticked `dtrain ...` command is run as the user would paste it, and the command it was printed
for then passes its data checks. The tokenizer's `use it:` line, the other tokenizer's `--force`,
the mixture's (a source of another tokenizer), a dataset not prepared for this tokenizer, and a
damaged manifest or shard. The hints of another source and of changed files run in
test_data_identity.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.dtrain import corpus_text, run_dtrain
from helpers.errors import error_line
from helpers.hints import run_hint
from helpers.tokenizers import byte_level_folder

from trainer.config.compose import compose
from trainer.preflight.checks import check_data

TRAIN = ["train", "model=tiny", "train.max_steps=1", "train.micro_batch_size=2", "train.seq_len=32",
         "train.val_tokens=64", "train.sample_tokens=0", "train.progress=false"]


def corpus(tmp_path: Path, name: str = "notes.txt", start: int = 0) -> Path:
    source = tmp_path / name
    source.write_text(corpus_text()[start:start + 40_000])
    return source


def tokenizer(tmp_path: Path) -> Path:
    return byte_level_folder(tmp_path / "tok", [corpus_text()[:100_000]], 300)


def refused(args: list[str]) -> str:
    """The one error line of the refused `dtrain` command, asserting it wrote no run directory."""
    run = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    line = error_line(run_dtrain(args))
    assert not run.exists()
    return line


def passes(args: list[str]) -> None:
    """The data checks the run of `args` makes before it starts pass (preflight.check_data)."""
    check_data(compose(args[1:]), world=1)


def test_tokenizer_trains_use_it_line_runs_as_printed(tmp_path):
    """`dtrain tokenizer train data=text data.name=notes ...` ends with `use it: dtrain prepare ...`:
    it printed `data=notes` (no such dataset), without data.source or data.dir."""
    source, data, tok = corpus(tmp_path), tmp_path / "data", tmp_path / "tok"
    keys = ["data=text", "data.name=notes", f"data.dir={data}"]
    run_dtrain(["prepare", *keys, f"data.source={source}"], check=True)
    trained = run_dtrain(["tokenizer", "train", *keys, f"data.source={source}", "tokenizer.vocab_size=300",
                          f"tokenizer.path={tok}"], check=True)
    use_it = next(line for line in trained.stdout.splitlines() if "use it:" in line)
    run_hint(use_it)
    passes([*TRAIN, *keys, "tokenizer=hf", f"tokenizer.path={tok}", f"hydra.run.dir={tmp_path / 'run'}"])


def test_the_other_tokenizer_hints_run_as_printed(tmp_path):
    """Training with a tokenizer the dataset was not prepared with: its folder is missing (`run
    dtrain prepare ... tokenizer=hf ...`), or holds another tokenizer's ids, here GPT-2's folder a
    copy of the other's (`... --force`). Both printed `data=text data.name=c` without data.source."""
    source, data, tok = corpus(tmp_path), tmp_path / "data", tokenizer(tmp_path)
    keys = ["data=text", "data.name=c", f"data.dir={data}"]
    run_dtrain(["prepare", *keys, f"data.source={source}"], check=True)
    with_tok = [*TRAIN, *keys, "tokenizer=hf", f"tokenizer.path={tok}", f"hydra.run.dir={tmp_path / 'run'}"]
    line = refused(with_tok)
    assert "is not prepared in" in line and ".tok-" in line, line
    run_hint(line)
    passes(with_tok)
    (made,) = data.glob("c.tok-*")
    shutil.rmtree(data / "c")
    shutil.copytree(made, data / "c")  # GPT-2's folder now holds the other tokenizer's ids
    gpt2 = [*TRAIN, *keys, f"hydra.run.dir={tmp_path / 'run'}"]
    line = refused(gpt2)
    assert "records tokenizer 'hf' with 300 ids" in line and line.endswith("--force`"), line
    run_hint(line)
    passes(gpt2)
    assert json.loads((data / "c" / "manifest.json").read_text())["tokenizer"] == "gpt2"


def test_the_mixtures_hints_run_as_printed(tmp_path):
    """A mixture of datasets prepared with GPT-2's ids, trained with another tokenizer: the first
    line says to prepare source 'a' again with it (`--force`), the next, 'a' and 'b' then being of
    two tokenizers, to prepare 'b' with it; each printed `data=text data.name=X` without data.source."""
    data, tok = tmp_path / "data", tokenizer(tmp_path)
    for name, start in (("a", 0), ("b", 40_000)):
        source = corpus(tmp_path, f"{name}.txt", start)
        run_dtrain(["prepare", "data=text", f"data.name={name}", f"data.source={source}", f"data.dir={data}"],
                   check=True)
    mix = [*TRAIN, "data=mix", "data.mix={a: 0.5, b: 0.5}", f"data.dir={data}", "tokenizer=hf",
           f"tokenizer.path={tok}", f"hydra.run.dir={tmp_path / 'run'}"]
    line = refused(mix)
    assert "records tokenizer 'gpt2'" in line and "data.name=a" in line, line
    run_hint(line)
    line = refused(mix)
    assert "data.mix's sources 'a' and 'b' were prepared with different tokenizers" in line, line
    assert "prepare 'b' with it" in line and "data.name=b" in line, line
    run_hint(line)
    passes(mix)


DAMAGE = {
    "a manifest of tokens as a string": lambda root: _edit_manifest(root, lambda m: m["splits"]["train"][0].update(
        tokens=str(m["splits"]["train"][0]["tokens"]))),
    "a shard missing": lambda root: (root / "train_000000.bin").unlink(),
}


def _edit_manifest(root: Path, edit) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_datasets_force_hint_runs_as_printed(damage, tmp_path):
    source, data = corpus(tmp_path), tmp_path / "data"
    keys = ["data=text", "data.name=c", f"data.dir={data}"]
    run_dtrain(["prepare", *keys, f"data.source={source}"], check=True)
    DAMAGE[damage](data / "c")
    args = [*TRAIN, *keys, f"hydra.run.dir={tmp_path / 'run'}"]
    line = refused(args)
    assert line.endswith("--force`"), line
    run_hint(line)
    passes(args)
