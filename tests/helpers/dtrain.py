"""Run `dtrain` as a user does (a subprocess of this interpreter, cwd the checkout) and read what
it wrote: the command lines of the tiny runs the tests train, the environment, metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the checkout
TINYSHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def corpus_text() -> str:
    """The tiny-shakespeare corpus when the shared copy is here (as in CI), else generated
    English-like text: a few common words among thousands of made-up ones, so that a byte-level BPE
    trained on it still finds over a thousand merges."""
    if TINYSHAKESPEARE.exists():
        return TINYSHAKESPEARE.read_text()
    import random

    rng = random.Random(0)
    common = ("the king hath spoken and my lord shall come to the court of rome where all the "
              "people cry for bread and wine good night sweet prince").split()
    syllables = [c + v for c in "bcdfghklmnprstvw" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    made_up = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(4000)]
    lines = []
    for i in range(20000):
        words = [rng.choice(common) if rng.random() < 0.6 else rng.choice(made_up) for _ in range(10)]
        lines.append(("ROMEO:" if i % 7 == 0 else "") + " ".join(words))
    return "\n".join(lines) + "\n"


def dtrain_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HYDRA_FULL_ERROR"] = "0"
    return env


def run_dtrain(args: list[str], cwd: Path | None = None, check: bool = False, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or dtrain_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"dtrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# The session dataset's own tokenizer (conftest.data_dir): a byte-level BPE trained on the corpus.
SMALL_VOCAB = 512
TOKENIZER_FOLDER = "tokenizer"


def prepare_corpus(root: Path, vocab: int | None) -> None:
    """`dtrain prepare` the corpus into `root`, with a BPE of `vocab` ids trained on it into
    root/TOKENIZER_FOLDER first (None: GPT-2's tokenizer)."""
    root.mkdir()
    source = root / "corpus.txt"
    source.write_text(corpus_text())
    data = ["data=text", "data.name=corpus", f"data.source={source}", f"data.dir={root}"]
    if vocab is not None:
        run_dtrain(["tokenizer", "train", *data, f"tokenizer.vocab_size={vocab}",
                    f"tokenizer.path={root / TOKENIZER_FOLDER}"], check=True)
    run_dtrain(["prepare", *data, "data.val_fraction=0.1", *tokenizer_args(root)], check=True)


def tokenizer_args(data_dir: Path) -> list[str]:
    """The overrides that read `data_dir` with its own tokenizer: the one in its TOKENIZER_FOLDER,
    else GPT-2's (the default)."""
    folder = data_dir / TOKENIZER_FOLDER
    return ["tokenizer=hf", f"tokenizer.path={folder}"] if folder.is_dir() else []


def tiny_args(data_dir: Path, run_dir: Path | None, *extra: str, sweep: bool = False) -> list[str]:
    """A fast tiny-model training run on the dataset in `data_dir` (its own tokenizer: tokenizer_args)
    into `run_dir`: 20 steps, no validation.
    sweep=True: a sweep (`train -m`, its values in `extra`) of 6-step points validated at steps 3 and
    6, into `run_dir` as hydra.sweep.dir (None: Hydra's default, multirun/ under the working folder)."""
    if sweep:
        command, into = ["train", "-m"], "sweep"
        length = ["train.max_steps=6", "train.val_interval=3", "optim.warmup_steps=2"]
    else:
        command, into = ["train"], "run"
        length = ["train.max_steps=20", "train.val_interval=0", "optim.warmup_steps=5"]
    folder = [f"hydra.{into}.dir={run_dir}"] if run_dir is not None else []
    return [*command, "model=tiny", "data=text", "data.name=corpus", f"data.dir={data_dir}",
            *tokenizer_args(data_dir), *length,
            "train.log_interval=1", "train.val_tokens=512", "train.sample_tokens=0", "train.progress=false",
            "train.micro_batch_size=4", "train.seq_len=64", *folder, *extra]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def inject(*steps: int) -> dict:
    return {**dtrain_env(), "DTRAIN_INJECT_NONFINITE": ",".join(map(str, steps))}


def args_with(data_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """tiny_args with `overrides` replacing the keys it sets (Hydra takes a key only once)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in tiny_args(data_dir, run_dir) if a.split("=", 1)[0] not in keys] + list(overrides)
