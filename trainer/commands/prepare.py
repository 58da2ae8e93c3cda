"""`dtrain prepare data=NAME [data.source=...] [--force]`: tokenize a dataset into token shards."""

from __future__ import annotations

from rich.console import Console

from trainer.commands.args import ArgParser
from trainer.config.compose import compose
from trainer.config.validation import check_ranges
from trainer.data.mixture import EXAMPLE
from trainer.data.origin import describe_source, source_settings
from trainer.errors import DataError
from trainer.prepare.pipeline import is_prepared, prepare, source_changes


def cmd_prepare(argv: list[str]) -> None:
    parser = ArgParser(prog="dtrain prepare",
                       description="Tokenize a dataset into token shards (uint16 ids, uint32 when the tokenizer's "
                                   "vocabulary exceeds 65,536) and a manifest.json that records its source.")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. data=tinyshakespeare data.source=input.txt")
    parser.add_argument("--force", action="store_true", help="prepare again even when already prepared")
    args = parser.parse_args(argv)
    cfg = compose(args.overrides)
    check_ranges(cfg, ("data",))  # e.g. data.shard_tokens=0 would never fill a shard
    if cfg.data.mix is not None or cfg.data.name == "mix":
        raise DataError(f"a mixture ({EXAMPLE}) trains on datasets prepared on their own; prepare each of "
                        "its sources: dtrain prepare data=NAME (or data=text data.name=NAME data.source=FILES)")
    changes = [] if args.force else source_changes(cfg.data)
    if changes:  # the same source, updated: prepared again (unless a live run reads it: in_use.py)
        Console(stderr=True).print(f"dtrain: {describe_source(source_settings(cfg.data))} changed on disk since "
                                   f"{cfg.data.name!r} was prepared from it ({'; '.join(changes)}): preparing it "
                                   "again", highlight=False, soft_wrap=True)
    reused = not args.force and is_prepared(cfg.data)
    manifest = prepare(cfg.data, force=args.force)
    if reused:
        Console().print(f"already prepared with these settings: {cfg.data.name}: {manifest} (--force prepares "
                        "it again)", highlight=False, soft_wrap=True)
    else:
        Console().print(f"[green]prepared[/] {cfg.data.name}: {manifest}", soft_wrap=True)
