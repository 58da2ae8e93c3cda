"""stdout and stderr that outlive their reader: `dtrain train ... | head -3`, a `| tee` or a pager
that exits, a Ctrl-C that takes the pipe's reader down with dtrain.

Python ignores SIGPIPE, so each write to a pipe whose reader left raises BrokenPipeError: a print of
a step line would end the run without a checkpoint, and at exit the interpreter's own flush would
turn the exit code into 120. A training run's product is its checkpoints and its files, not the
terminal: as logging never lets a record's write end the program (Handler.handleError), dtrain goes
on. `survive_closed_readers` puts both standard streams on a writer that, at its first
BrokenPipeError, points the file descriptor at /dev/null (what the Python docs advise for SIGPIPE:
everything holding the descriptor, C code and the interpreter's exit flush included, then writes
there) and carries on; dtrain.log and metrics.jsonl are files and get every line as before. While
`when_a_reader_leaves` is active, the first reader to leave is reported once (a training run's rank
0 says so on stderr and in dtrain.log: trainer.process.joblog.job_log).
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.RLock()  # a listener writes to the other stream, whose reader may have left too
_listeners: list[Callable[[str], None]] = []  # when_a_reader_leaves: the innermost is told
_told = False


class ReaderProofStream(io.TextIOWrapper):
    """A standard stream whose writes and flushes never raise BrokenPipeError (see the module)."""

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except BrokenPipeError:
            _reader_left(self)
            return len(text)

    def flush(self) -> None:
        try:
            super().flush()
        except BrokenPipeError:
            _reader_left(self)


def reader_proof(stream: io.TextIOWrapper) -> ReaderProofStream:
    """A ReaderProofStream on `stream`'s file descriptor, with its encoding and buffering."""
    stream.flush()
    buffered = not isinstance(stream.buffer, io.RawIOBase)  # PYTHONUNBUFFERED: text straight to the fd
    raw = io.FileIO(stream.fileno(), "wb", closefd=False)  # sys.__stdout__ still owns the descriptor
    return ReaderProofStream(io.BufferedWriter(raw) if buffered else raw, encoding=stream.encoding,
                             errors=stream.errors, newline="\n", line_buffering=stream.line_buffering,
                             write_through=stream.write_through)


def survive_closed_readers() -> None:
    """sys.stdout and sys.stderr become ReaderProofStreams (once per process: the `dtrain` command
    and every worker its launcher starts). Loggers configured later (Hydra's console handler on
    ext://sys.stdout) and rich's consoles, which look sys.stdout up at each print, write through them."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and not isinstance(stream, ReaderProofStream):
            try:
                setattr(sys, name, reader_proof(stream))
            except (OSError, ValueError):  # no file descriptor behind it (io.UnsupportedOperation), or closed
                continue


@contextmanager
def when_a_reader_leaves(call: Callable[[str], None]) -> Iterator[None]:
    """While active, the first reader to leave in this process is told once: call("stdout") or
    call("stderr"), once that stream's descriptor points at /dev/null (a write to it is harmless)."""
    _listeners.append(call)
    try:
        yield
    finally:
        _listeners.remove(call)


def _reader_left(stream: ReaderProofStream) -> None:
    global _told
    with _lock:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)  # a pipe without a reader now: once it is /dev/null, no write fails again
        os.close(devnull)
        super(ReaderProofStream, stream).flush()  # what the pipe refused, to /dev/null
        if _listeners and not _told:
            _told = True
            _listeners[-1]({1: "stdout", 2: "stderr"}.get(fd, f"file descriptor {fd}"))
