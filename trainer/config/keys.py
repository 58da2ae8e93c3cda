"""Every config key is one of two kinds, for a run directory's command run again (trainer/preflight/rundir.py):

- trajectory keys decide what the model learns: the model, the data, the optimizer and its
  schedule (max_steps included), the seed, the batch arithmetic, the dtype, the non-finite policy.
  A continuation with one of them changed would not be the run the directory holds, so it is one
  `error:` line (`resume=PATH` continues a checkpoint with new settings on purpose).
- operational keys say how the run is launched, watched and saved: world size and mode, launch
  settings, how often it logs, evaluates, samples and checkpoints, how many checkpoints it keeps,
  trackers, progress bars. The same command with them changed continues the run (the record is
  rewritten with a line saying what changed). The losses are those of an uninterrupted run, bitwise
  unless the change takes floating-point sums in another order (threads, world, mode, compile, loss
  pieces: within ~1e-5 on CPU, and the resume says so: trainer/checkpoint/resume_notes.py).

An entry ending in "." covers a whole section; a key matched in both tables takes the kind of the
longer entry (model.attention, an operational key inside the trajectory section model.).
tests/cli/test_rundir.py fails when a key of the schema is in neither table (or an entry in both).
Torch-free, like the schema.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from fractions import Fraction

from omegaconf import DictConfig, OmegaConf

from trainer.io import dotted_keys

TRAJECTORY = (
    "model.",
    "data.name", "data.dir", "data.source", "data.sha256", "data.val_fraction", "data.shard_tokens",
    "data.hf_path", "data.hf_name", "data.hf_split", "data.text_field", "data.max_tokens",
    "data.mix", "data.mix.",  # a mixture's sources and their weights (data.mix.NAME: each weight)
    "optim.",
    "train.seed", "train.max_steps", "train.micro_batch_size", "train.seq_len", "train.total_batch_size",
    "train.grad_accum_steps", "train.dtype", "train.on_nonfinite", "train.max_nonfinite",
    "train.float8",  # float8 matmuls round what every step computes, as train.dtype does
    # the ids the data holds (data.tokenizer mirrors the `tokenizer` group for the data functions)
    "tokenizer.name", "tokenizer.path", "data.tokenizer.name", "data.tokenizer.path",
)

# Trajectory keys that a continuation compares by the global batch they make, not by their values:
# the checkpoint records that batch, and another world size keeps it with another accumulation
# (trainer/preflight/continuation.py), so giving the recorded total is no change of setting.
BATCH_KEYS = ("train.total_batch_size", "train.grad_accum_steps")

# Keys renamed so that a name says what it is, old name -> new, the one table of them: validation
# loss (train.val_*) is not HellaSwag (eval.*), and train.val_batches counted micro batches where
# train.val_tokens counts tokens (its value converted: _val_batches_as_tokens). The old names still
# work, with a notice: the schema carries each as a None field made from this table
# (schema.py with_old_names), and every composed or recorded config moves a value given under an
# old name to the new one, in this order (eval_batches's value goes on to val_tokens).
RENAMED_KEYS = {
    "train.eval_interval": "train.val_interval",
    "train.eval_batches": "train.val_batches",
    "eval.interval": "eval.hellaswag.interval",
    "train.val_batches": "train.val_tokens",
}

OPERATIONAL = (
    # launched: any world size and mode reshard the checkpoint; compile (and its mode), activation
    # checkpointing and the loss's pieces change how the same steps run (to rounding), not which
    "world", "parallel.", "launch.", "resume", "sweep.", "train.device", "train.compile",
    "train.activation_checkpointing", "train.compile_mode", "train.loss_chunks", "train.loss_kernel",
    # which SDPA kernel computes attention: the same weights and the same attention, to rounding
    "model.attention",
    # watched
    "train.log_interval", "train.val_interval", "train.val_tokens", "train.progress",
    "train.profile.", "train.memory_snapshot", "train.straggler_ratio", "train.straggler_every",
    # the old names (RENAMED_KEYS), each moved to its new key before anything reads it
    *RENAMED_KEYS,
    "train.sample_prompt", "train.sample_tokens", "train.peak_flops", "eval.", "logger",
    # when the run ends, not what any step learns: a target stops it early as a stop signal would,
    # and the summary's `target` record names the target it met
    "train.target_val_loss", "train.target_val_bpb", "train.continue_after_target",
    # saved, and how data is checked or prepared
    "checkpoint.", "data.verify", "data.num_proc", "data.auto_prepare",
    "tokenizer.vocab_size", "data.tokenizer.vocab_size",  # only `dtrain tokenizer train` reads it
    # where a run's tokenizer is read from, not which: its identity (fingerprint) is checked against
    # the data's and the checkpoint's (trainer/preflight/run_tokenizer.py)
    "tokenizer.checkpoint", "data.tokenizer.checkpoint",
)


# Trajectory keys added after runs were recorded, each with the value that means what a run
# recorded without it did. At that value a key is left out of the run folder's digest, and a record
# that lacks it holds that value: the same command, typed again after an upgrade, finds and
# continues the run it started before (tests/unit/test_run_names.py).
ADDED_KEYS = {
    "data.text_field": "text",
    "data.mix": None,
    "train.float8": "off",
    "model.head_dim": None,  # n_embd / n_head
    # a dense model (the mixture-of-experts group's defaults)
    "model.moe.num_experts": 0,
    "model.moe.top_k": 2,
    "model.moe.num_shared_experts": 0,
    "model.moe.expert_hidden": None,
    "model.moe.every": 1,
    "model.moe.aux_loss_coef": 0.001,
    "model.moe.norm_topk_prob": True,
}


def without_added_defaults(keys: dict) -> dict:
    """Dotted keys less the ADDED_KEYS at the value an older run's record implies."""
    return {k: v for k, v in keys.items() if k not in ADDED_KEYS or v != ADDED_KEYS[k]}


def comparable_keys(config: dict) -> dict:
    """The dotted keys runs are compared and named by (a resolved config as plain data): less the
    ADDED_KEYS at their older meaning, and a mixture's weights normalized, since weights in the same
    proportions (`{a: 7, b: 3}`, `{a: 0.7, b: 0.3}`) are the same data, read in the same order."""
    data = config.get("data")
    mix = data.get("mix") if isinstance(data, dict) else None
    if isinstance(mix, dict) and mix and all(is_weight(w) for w in mix.values()):
        config = {**config, "data": {**data, "mix": normalized_weights(mix)}}
    return without_added_defaults(dotted_keys(config))


def normalized_weights(mix: dict) -> dict[str, float]:
    """A mixture's weights over their sum, by name (positive numbers: trainer/data/mixture.py checks
    them). Each is rounded once from the exact quotient of the numbers as written (a float's shortest
    decimal), so weights in one proportion give the same floats whichever way they are written
    (`{a: 0.3, b: 0.3, c: 0.3}` and `{a: 1, b: 1, c: 1}` too, which plain division tells apart)."""
    exact = {str(name): Fraction(w) if isinstance(w, int) else Fraction(repr(float(w))) for name, w in mix.items()}
    total = sum(exact.values())
    return {name: float(exact[name] / total) for name in sorted(exact)}


def is_weight(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _longest_match(key: str, entries: tuple[str, ...]) -> int:
    """The length of the longest entry that covers `key` (0: none does)."""
    return max((len(e) for e in entries if key == e or (e.endswith(".") and key.startswith(e))), default=0)


def _matches(key: str, entries: tuple[str, ...]) -> bool:
    return _longest_match(key, entries) > 0


def key_kind(key: str) -> str | None:
    """"trajectory", "operational", or None for a key in neither table (a dotted config key). The
    longer matching entry decides: `model.attention` is operational inside the trajectory `model.`."""
    trajectory, operational = _longest_match(key, TRAJECTORY), _longest_match(key, OPERATIONAL)
    if not trajectory and not operational:
        return None
    return "trajectory" if trajectory > operational else "operational"


def is_operational(key: str) -> bool:
    return key_kind(key) == "operational"


# A sweep's overrides that steer the sweep itself (or Hydra) and do not change what a point trains.
NOT_IDENTITY = ("sweep.", "hydra.", "hydra/")


def identity(overrides: list[str]) -> list[str]:
    """The overrides that decide what a run trains (sweep.* and hydra settings excluded)."""
    return [o for o in overrides if not o.lstrip("+~").startswith(NOT_IDENTITY)]


def sweep_identity(overrides: list[str], swept: list[str], config_name: str) -> str:
    """The default sweep folder's name for a sweep's overrides as typed (`optim.lr=1e-3,3e-3 ...`):
    `<the swept keys>-<digest>`, the digest over the primary config's name and the overrides that
    decide what the points train, which the sweep's points are also checked against when it runs
    again (trainer/launch/sweep.py). The same `-m` command, run again, finds the same folder and
    skips the points that finished; another sweep gets another folder."""
    digest = hashlib.sha256(json.dumps([config_name, identity(overrides)]).encode()).hexdigest()[:8]
    keys = "_".join(dict.fromkeys(key.lstrip("+~") for key in swept))
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in (keys, digest) if p)


def run_identity(config: dict) -> str:
    """The default run directory's name for a resolved config (plain data, no hydra section):
    `<model>-<data>-<digest>`, the digest over the trajectory keys. The same command, run again,
    finds the same folder and continues there; a changed operational key (world, mode, intervals)
    keeps it, a changed trajectory key is another run in another folder. The batch keys are left
    out: the global batch they make is checked against the checkpoint's (a continuation told to
    repeat train.total_batch_size must land in the same folder)."""
    keys = {k: v for k, v in comparable_keys(config).items() if key_kind(k) == "trajectory" and k not in BATCH_KEYS}
    digest = hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:8]
    model, data = config.get("model", {}).get("name"), config.get("data", {}).get("name")
    parts = [str(p) for p in (model, data) if p] + [digest]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts)


def apply_renamed_keys(cfg: DictConfig) -> list[str]:
    """Move values set under an old name (RENAMED_KEYS) to the new one (the old name wins: it is
    what the user wrote), train.val_batches converted to tokens; returns one notice per old key
    used."""
    notices = []
    for old, new in RENAMED_KEYS.items():
        notice = _val_batches_as_tokens(cfg) if old == "train.val_batches" else _moved(cfg, old, new)
        if notice:
            notices.append(notice)
    return notices


def _moved(cfg: DictConfig, old: str, new: str) -> str | None:
    value = OmegaConf.select(cfg, old, default=None)
    if value is None:
        return None
    OmegaConf.update(cfg, new, value, merge=False)
    OmegaConf.update(cfg, old, None, merge=False)
    return f"{old} is now {new} (the old name still works; {new}={value} is what it set)"


def _val_batches_as_tokens(cfg: DictConfig) -> str | None:
    """train.val_batches counted micro batches, so the validation set moved with the micro batch and
    two runs' figures scored different tokens; train.val_tokens counts tokens. A val_batches given
    (a command, a preset, an older run's record) sets val_tokens to the tokens it read at the run's
    own micro batch and seq_len (it wins over val_tokens, as an old name does), with a notice."""
    batches = OmegaConf.select(cfg, "train.val_batches", default=None)
    if not isinstance(batches, int) or batches < 0:  # none given; or out of range: validation names it
        return None
    train = cfg.train
    tokens = batches * train.micro_batch_size * train.seq_len
    train.val_tokens, train.val_batches = tokens, None
    return (f"train.val_batches={batches} is now train.val_tokens={tokens} ({batches} x micro batch "
            f"{train.micro_batch_size} x seq_len {train.seq_len}): the validation set is a number of tokens "
            "and no longer moves with the micro batch; set train.val_tokens instead")
