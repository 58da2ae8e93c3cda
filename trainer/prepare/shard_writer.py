"""Writing the token stream to disk and cutting it into train and val shards.

Tokens are appended to ``stream_NNNNNN.bin`` files while tokenizing (the total is unknown until
the end); the val split is the stream's last tokens, copied out into ``val_*`` shards, and the
stream files, truncated at the cut, are renamed to the ``train_*`` shards.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from trainer.data.layout import DTYPE


class StreamWriter:
    """Appends tokens to ``stream_NNNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, shard_tokens: int, dtype: np.dtype = DTYPE):
        self.folder, self.shard_tokens, self.dtype = folder, shard_tokens, dtype
        self.files: list[tuple[Path, int]] = []  # (path, tokens), in stream order
        self._f = None
        self.total = 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._f is None or self.files[-1][1] >= self.shard_tokens:
                self._open_next()
            path, count = self.files[-1]
            take = min(len(tokens), self.shard_tokens - count)
            self._f.write(tokens[:take].tobytes())
            self.files[-1] = (path, count + take)
            self.total += take
            tokens = tokens[take:]

    def _open_next(self) -> None:
        if self._f is not None:
            self._f.close()
        path = self.folder / f"stream_{len(self.files):06d}.bin"
        self._f = open(path, "wb", buffering=1 << 22)
        self.files.append((path, 0))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _copy_range(writer: StreamWriter, start: int, stop: int, out: Path, prefix: str, shard_tokens: int):
    """Copy stream tokens [start, stop) into ``<prefix>_NNNNNN.bin`` shards; their (path, tokens)."""
    shards, f, count = [], None, 0
    base = 0
    for path, n in writer.files:
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            mm = np.memmap(path, dtype=writer.dtype, mode="r")
            pos = lo
            while pos < hi:
                if f is None or count >= shard_tokens:
                    if f is not None:
                        f.close()
                        shards[-1] = (shards[-1][0], count)
                    shards.append((out / f"{prefix}_{len(shards):06d}.bin", 0))
                    f, count = open(shards[-1][0], "wb"), 0
                take = min(hi - pos, shard_tokens - count, 1 << 24)
                f.write(mm[pos - base : pos - base + take].tobytes())
                pos += take
                count += take
            del mm
        base += n
    if f is not None:
        f.close()
        shards[-1] = (shards[-1][0], count)
    return shards


def split_stream(writer: StreamWriter, n_val: int, out: Path, shard_tokens: int):
    """Turn the stream files into train shards (all but the last n_val tokens) and val shards."""
    cut = writer.total - n_val
    val = _copy_range(writer, cut, writer.total, out, "val", shard_tokens)
    train, base = [], 0
    for path, n in writer.files:
        keep = min(n, max(0, cut - base))
        if keep:
            if keep < n:
                os.truncate(path, keep * writer.dtype.itemsize)
            final = out / f"train_{len(train):06d}.bin"
            os.replace(path, final)
            train.append((final, keep))
        else:
            path.unlink()
        base += n
    return train, val
