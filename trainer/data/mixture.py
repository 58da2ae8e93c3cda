"""Weighted mixtures of prepared datasets: `data=mix data.mix='{fineweb_edu: 0.7, my_code: 0.3}'`.

The sources are datasets prepared in data.dir on their own (`dtrain prepare data=NAME`), all with
one tokenizer. Every sequence of the token stream (seq_len tokens and the next one) is drawn from one
source: sequence after sequence of the run, a smooth weighted round-robin (Schedule) picks the
source furthest behind its share, so every optimizer step holds each source's share to within one
sequence, and which sequence comes from where depends on the run's sequence count alone, not on the
world size, the micro batch or the accumulation (the loader: trainer/data/mix_loader.py). Torch-free:
the checks before a run (trainer/preflight/checks.py) and the data's identity (identity.py) use it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.config.keys import is_weight, normalized_weights
from trainer.data.hints import prepare_hint
from trainer.data.layout import MANIFEST, as_data_cfg, dataset_dir, prepared_folders
from trainer.data.manifest import describe_tokenizer, load_manifest, recorded_tokenizer
from trainer.data.shard_reader import open_split, refuse_foreign_tokenizer, run_tokenizer
from trainer.errors import ConfigError, DataError

MIX_NAME = "mix"  # conf/data/mix.yaml's data.name
EXAMPLE = "data.mix='{fineweb_edu: 0.7, my_code: 0.3}'"


def mixture_weights(data_cfg) -> dict[str, float] | None:
    """{source: weight} by name, the weights normalised to sum 1; None for one dataset. A mixture
    without sources, a weight that is not a positive number or a source that is not a folder name
    is one ConfigError line."""
    mix = data_cfg.get("mix")
    if mix is None or (isinstance(mix, (dict, DictConfig)) and len(mix) == 0):
        if data_cfg.get("name") == MIX_NAME:
            raise ConfigError(f"data=mix needs its sources: {EXAMPLE} (datasets prepared in data.dir, each "
                              "with `dtrain prepare data=NAME`), or choose one dataset with data=NAME")
        return None
    if isinstance(mix, DictConfig):
        mix = OmegaConf.to_container(mix, resolve=True)
    if not isinstance(mix, dict) or not mix:
        raise ConfigError(f"data.mix={mix!r} is not a mapping of dataset names to weights; e.g. {EXAMPLE}")
    for name, weight in mix.items():
        if not str(name).strip() or str(name) in (".", "..") or "/" in str(name) or os.sep in str(name):
            raise ConfigError(f"data.mix names {name!r}, not a dataset's folder name in data.dir; e.g. {EXAMPLE}")
        if not is_weight(weight):
            raise ConfigError(f"data.mix gives {name!r} the weight {weight!r}: a weight is a positive number "
                              f"(the weights are normalised to sum 1); e.g. {EXAMPLE}")
    return normalized_weights(mix)


def source_configs(data_cfg) -> dict[str, DictConfig]:
    """{source: its data config} (the mixture's data.dir, data.verify and tokenizer, its own name), by
    name; empty for one dataset."""
    weights = mixture_weights(data_cfg)
    if weights is None:
        return {}
    cfg = as_data_cfg(data_cfg)
    values = OmegaConf.to_container(cfg, resolve=True)
    return {name: OmegaConf.create({**values, "name": name, "mix": None, "source": None, "sha256": None})
            for name in weights}


def describe_data(data_cfg) -> str:
    """"dataset 'x' in FOLDER", or "data.mix's datasets 'a', 'b' in DIR", for messages."""
    cfg = as_data_cfg(data_cfg)
    sources = source_configs(cfg)
    if not sources:
        return f"dataset {cfg.name!r} in {dataset_dir(cfg)}"
    return f"data.mix's datasets {', '.join(map(repr, sources))} in {cfg.dir}"


def _found(source: DictConfig) -> tuple[Path, dict] | None:
    """The source's folder and manifest: prepared with the run's tokenizer, else with any other one
    (layout.prepared_folders); None when not prepared."""
    for folder in prepared_folders(source):
        manifest = load_manifest(folder / MANIFEST)
        if manifest is not None:
            return folder, manifest
    return None


def check_sources(data_cfg) -> None:
    """Every source is prepared, all with one tokenizer, the run's: one DataError line otherwise,
    whose `dtrain prepare` runs as printed (hints.prepare_hint)."""
    configs = source_configs(data_cfg)
    found = {}
    for name, source in configs.items():
        hit = _found(source)
        if hit is None:
            raise DataError(f"data.mix's source {name!r} is not prepared in {source.dir}; {prepare_hint(source)} "
                            "(a mixture reads datasets prepared on their own)")
        found[name] = hit
    (first, (first_folder, first_manifest)), *others = found.items()
    ours = recorded_tokenizer(first_manifest)
    for name, (folder, manifest) in others:
        theirs = recorded_tokenizer(manifest)
        if theirs != ours:
            run = run_tokenizer(configs[first])
            redo = name if theirs != run else first  # the one not prepared with the run's tokenizer
            in_place = found[redo][0] == dataset_dir(configs[redo])  # a folder of another's ids under ours
            raise DataError(
                f"data.mix's sources {first!r} and {name!r} were prepared with different tokenizers: {first!r} "
                f"({first_folder}) with {describe_tokenizer(ours)}, {name!r} ({folder}) with "
                f"{describe_tokenizer(theirs)}; a mixture reads one tokenizer's ids, this run's "
                f"({describe_tokenizer(run)}): prepare {redo!r} with it: {prepare_hint(configs[redo], in_place)}"
            )
    refuse_foreign_tokenizer(configs[first], first_folder / MANIFEST, first_manifest)


def check_mixture_data(cfg, val_need: int, hold: Callable[[Path], None] | None = None) -> None:
    """A mixture's data before a run (preflight.check_data's): its weights, its sources (prepared, one
    tokenizer), a shard of each source's train split holding one sequence and, when the run
    validates (`val_need` tokens, preflight.check_data's: 0 without validation), one of its val split
    holding one validation sequence (each source's validation set: trainer/data/val_set.py). `hold`:
    takes each source's folder (the run's lock on it, against a re-prepare)."""
    check_sources(cfg.data)
    t = cfg.train
    for name, source in source_configs(cfg.data).items():
        if hold is not None:
            hold(dataset_dir(source))
        needs = {"train": (t.seq_len + 1, "one sequence", "lower train.seq_len")}
        if val_need:
            needs["val"] = (val_need, "one validation sequence",
                            "lower train.seq_len, or set train.val_tokens=0 to train without validation")
        for split, (need, what, fix) in needs.items():
            have = max((len(s) for s in open_split(source, split)), default=0)
            if have < need:
                raise DataError(f"the {split} split of data.mix's source {name!r} holds at most {have:,} tokens per "
                                f"shard but {what} needs {need:,} (seq_len, +1); {fix}, or prepare {name!r} "
                                "from more text")


class Schedule:
    """Smooth weighted round-robin over the sources (nginx's): each pick adds every source's weight
    to its credit and takes the source with the most (the first by name on a tie), which then pays
    the weights' sum. Each source's count stays within about one of weight x picks at every pick, and
    the picks depend on nothing but the weights and the credits (saved with the loader's position)."""

    def __init__(self, weights: dict[str, float]):
        self.names = list(weights)
        self.weights = [weights[n] for n in self.names]
        self.total = math.fsum(self.weights)
        self.credit = [0.0] * len(self.names)

    def next(self) -> int:
        """The index (in `names`) of the source of the next sequence."""
        best = 0
        for i, weight in enumerate(self.weights):
            self.credit[i] += weight
            if self.credit[i] > self.credit[best]:
                best = i
        self.credit[best] -= self.total
        return best

    def state_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self.credit))

    def load_state_dict(self, credits: dict[str, float]) -> None:
        """Sources the saved schedule did not have (a resume= with another mix) start at no credit."""
        self.credit = [float(credits.get(name, 0.0)) for name in self.names]


def mixed_figures(sums: dict[str, list[float]], weights: dict[str, float]) -> dict[str, float]:
    """Validation of a mixture from each source's validation set: [nats over every target, nats over
    the targets that stand for bytes, their bytes, targets]: `val_loss/<source>` (nats per token) and
    `val_bpb/<source>`, and overall the expected figures of the mixture's token stream, each source
    at its weight: `val_loss` the weighted loss per token, `val_bpb` the weighted bits per token over
    the weighted bytes per token."""
    figures: dict[str, float] = {}
    bits = nbytes = 0.0
    for name, (nats, nats_in_bytes, source_bytes, targets) in sums.items():
        figures[f"val_loss/{name}"] = nats / targets
        figures[f"val_bpb/{name}"] = nats_in_bytes / (math.log(2) * source_bytes) if source_bytes else math.nan
        bits += weights[name] * nats_in_bytes / math.log(2) / targets
        nbytes += weights[name] * source_bytes / targets
    overall = {"val_loss": math.fsum(weights[name] * figures[f"val_loss/{name}"] for name in sums),
               "val_bpb": bits / nbytes if nbytes else math.nan}
    return {**overall, **figures}
