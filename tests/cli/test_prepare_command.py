"""`dtrain prepare` as a user types it: what it says the first time and the next, and its help.
(tests/unit/test_prepare.py checks the preparation itself in-process.)"""

from __future__ import annotations

from helpers.dtrain import run_dtrain


def test_prepare_says_whether_it_prepared_or_found_the_data_prepared(tmp_path):
    """`dtrain prepare` the first time says "prepared"; the same command again says the data was
    already prepared with these settings (and how to redo it), not "prepared"."""
    source = tmp_path / "notes.txt"
    source.write_text("To be, or not to be, that is the question.\n" * 400)
    args = ["prepare", "data=text", "data.name=notes", f"data.source={source}", f"data.dir={tmp_path / 'data'}"]
    first = run_dtrain(args, check=True)
    assert "prepared notes" in first.stdout and "already" not in first.stdout, first.stdout
    again = run_dtrain(args, check=True)
    assert "already prepared with these settings" in again.stdout and "--force" in again.stdout, again.stdout


def test_prepare_help_names_both_shard_dtypes():
    """`dtrain prepare --help` said "uint16 token shards" (issue 45 finding 18): a vocabulary over
    65,536 ids is written as uint32."""
    text = " ".join(run_dtrain(["prepare", "--help"], check=True).stdout.split())
    assert "uint16 ids, uint32 when the tokenizer's vocabulary exceeds 65,536" in text, text
