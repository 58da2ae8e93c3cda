"""Checksums of a checkpoint's files, recorded in its COMPLETE marker and verified before a load.

DCP stores no checksums (a flipped byte inside a shard loads without error), so every file of a
checkpoint gets one: each rank hashes the shard files it wrote, rank 0 hashes its index and JSON
files and writes them all into the marker, last. The marker's JSON:

    {"step": 12, "world": 2, "format": 1, "checksum": "xxh3_128",
     "files": {"__0_0.distcp": "xxh3_128:1a2b...", ".metadata": "xxh3_128:...", ...},
     "bytes": {"__0_0.distcp": 1234567, ...}}

Each checksum carries its algorithm (`xxh3_128:<hex>`), so the default can change without making
older checkpoints unreadable. xxh3 (the small `xxhash` package) hashes at memory speed: 15 GB/s
here against 3.9 GB/s for zlib's crc32, the fastest in the standard library, whose cost was 37-44%
of a gpt2_124m save (scripts/bench_checksum.py prints both). It detects storage faults, not
tampering: loading never unpickles arbitrary objects anyway.

No torch, like layout.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from trainer.checkpoint.layout import CHECKPOINT_DIR, MARKER, METADATA_FILE, checkpoint_step, marked_checkpoints
from trainer.errors import CheckpointError

CHECKSUM_ALGO = "xxh3_128"
SHARD_SUFFIX = ".distcp"
_CHUNK = 8 << 20
_THREADS = 4


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files do not match what its save recorded (or that lacks one it needs)."""

    def __init__(self, ckpt: Path, reason: str, message: str | None = None):
        self.ckpt, self.reason = Path(ckpt), reason
        super().__init__(message or f"checkpoint {ckpt} is corrupt ({reason})")


def _crc32(path: Path) -> str:
    value = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            value = zlib.crc32(view[:n], value)  # releases the GIL on large buffers
    return f"{value:08x}"


def _streamed(new_hasher):
    """A file digest by any hasher with update/hexdigest (hashlib's, xxhash's), read in chunks."""
    def digest(path: Path) -> str:
        h = new_hasher()
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
        return h.hexdigest()

    return digest


ALGORITHMS = {"xxh3_128": _streamed(xxhash.xxh3_128), "crc32": _crc32,
              "sha256": _streamed(hashlib.sha256), "blake2b": _streamed(hashlib.blake2b)}


def checksum_file(path: Path, algo: str = CHECKSUM_ALGO) -> str:
    """`<algo>:<hex>` of one file."""
    return f"{algo}:{ALGORITHMS[algo](Path(path))}"


def checksum_files(folder: Path, names: list[str], algo: str = CHECKSUM_ALGO) -> dict[str, tuple[int, str]]:
    """{name: (size in bytes, `<algo>:<hex>`)} for files of one folder, hashed in parallel threads."""
    folder = Path(folder)

    def one(name: str) -> tuple[int, str]:
        path = folder / name
        return path.stat().st_size, checksum_file(path, algo)

    with ThreadPoolExecutor(max_workers=min(_THREADS, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(one, names)))


def rank_files(folder: Path, rank: int) -> list[str]:
    """The files a rank wrote in a DCP save: DCP names each rank's shards `__<rank>_<n>.distcp`, and
    rank 0 (the coordinator) also writes the index."""
    names = sorted(p.name for p in Path(folder).glob(f"__{rank}_*{SHARD_SUFFIX}"))
    return names + [METADATA_FILE] if rank == 0 else names


def marker_record(folder: Path, step: int, world: int, fmt: int, sums: dict[str, tuple[int, str]]) -> dict:
    """The marker's JSON: the ranks' checksums plus any file in the folder no rank claimed (hashed
    here, so a change in DCP's file naming never leaves a file unchecked)."""
    folder = Path(folder)
    unclaimed = sorted(p.name for p in folder.iterdir() if p.name != MARKER and p.name not in sums)
    sums = {**sums, **checksum_files(folder, unclaimed)}
    return {
        "step": step,
        "world": world,
        "format": fmt,
        "checksum": CHECKSUM_ALGO,
        "files": {name: sums[name][1] for name in sorted(sums)},
        "bytes": {name: sums[name][0] for name in sorted(sums)},
    }


def read_marker(ckpt: Path) -> dict:
    path = Path(ckpt) / MARKER
    try:
        marker = json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        raise CorruptCheckpoint(ckpt, f"no {MARKER} marker") from None
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(ckpt, f"unreadable {MARKER} marker: {type(err).__name__}") from None
    if not isinstance(marker, dict):
        raise CorruptCheckpoint(ckpt, f"{MARKER} marker is not a JSON object")
    return marker


def _what(name: str) -> str:
    return f"shard file {name}" if name.endswith(SHARD_SUFFIX) else name


def verify_checkpoint_files(ckpt: Path) -> bool:
    """Check every file against the marker: missing, extra, resized or changed files raise
    CorruptCheckpoint naming the file. False for a checkpoint without checksums (an older format)."""
    ckpt = Path(ckpt)
    marker = read_marker(ckpt)
    recorded = marker.get("files")
    if recorded is None:
        return False
    sizes = marker.get("bytes", {})
    if not isinstance(recorded, dict) or not isinstance(sizes, dict):
        raise CorruptCheckpoint(ckpt, f"{MARKER} marker's file list is malformed")
    present = {p.name: p for p in ckpt.iterdir() if p.name != MARKER}
    for name in sorted(recorded):
        if name not in present:
            raise CorruptCheckpoint(ckpt, f"missing {_what(name)}")
    for name in sorted(present):
        if name not in recorded:
            raise CorruptCheckpoint(ckpt, f"unexpected file {name}, not written by its save")
    for name, path in sorted(present.items()):
        size, want = path.stat().st_size, sizes.get(name)
        if want is not None and size != want:
            kind = "truncated shard file" if size < want and name.endswith(SHARD_SUFFIX) else "corrupt"
            raise CorruptCheckpoint(ckpt, f"{kind} {name}: {size:,} bytes, {want:,} recorded")
    names = sorted(present)
    by_algo: dict[str, list[str]] = {}
    for name in names:
        by_algo.setdefault(_known_algorithm(ckpt, recorded[name]), []).append(name)
    for algo, group in by_algo.items():
        for name, (_, got) in checksum_files(ckpt, group, algo).items():
            if got != recorded[name]:
                raise CorruptCheckpoint(ckpt, f"{name}: {algo} mismatch, {got} vs {recorded[name]} recorded")
    return True


def _known_algorithm(ckpt: Path, checksum: str) -> str:
    """The algorithm of a recorded `<algo>:<hex>`; CheckpointError for one this dtrain lacks."""
    algo = str(checksum).partition(":")[0]
    if algo not in ALGORITHMS:
        raise CheckpointError(f"checkpoint {ckpt} records {algo!r} checksums, which this dtrain does not know; "
                              "use the dtrain version that wrote it")
    return algo


def verify_named_files(ckpt: Path, names: list[str]) -> None:
    """The named files of a checkpoint against the checksums its marker records: a reader of a few
    small files (a tokenizer copy and the records naming it) checks those without hashing the
    shards. A name neither recorded nor present is skipped; nothing is checked in a checkpoint from
    before checksums."""
    ckpt = Path(ckpt)
    recorded = read_marker(ckpt).get("files")
    if not isinstance(recorded, dict):
        return
    for name in names:
        path, want = ckpt / name, recorded.get(name)
        if not path.is_file():
            if want is not None:
                raise CorruptCheckpoint(ckpt, f"missing {_what(name)}")
            continue
        if want is None:
            raise CorruptCheckpoint(ckpt, f"unexpected file {name}, not written by its save")
        algo = _known_algorithm(ckpt, want)
        got = checksum_file(path, algo)
        if got != want:
            raise CorruptCheckpoint(ckpt, f"{name}: {algo} mismatch, {got} vs {want} recorded")


def alternative_hint(ckpt: Path, alternative: Path | None) -> str:
    """What to say after "checkpoint X is corrupt": the newest intact checkpoint beside it, or none."""
    if alternative is not None:
        return f"the newest intact checkpoint is {alternative}: resume={alternative}"
    return f"no intact checkpoint is left under {checkpoints_root(ckpt)}; start afresh in another hydra.run.dir="


def checkpoints_root(ckpt: Path) -> Path:
    """The `checkpoints/` folder a `step_*` checkpoint (or a run directory) belongs to."""
    ckpt = Path(ckpt)
    return ckpt.parent if checkpoint_step(ckpt) is not None else ckpt / CHECKPOINT_DIR


def check_chosen_files(ckpt: Path) -> None:
    """An explicitly chosen checkpoint's files, checked before anything is written (no torch): a
    corrupt one is one CheckpointError naming the newest checkpoint beside it whose files verify."""
    try:
        verify_checkpoint_files(ckpt)
    except CorruptCheckpoint as err:
        alternative = next((c for c in marked_checkpoints(checkpoints_root(ckpt))
                            if c.resolve() != Path(ckpt).resolve() and _files_intact(c)), None)
        raise CheckpointError(f"{err}; {alternative_hint(ckpt, alternative)}") from None


def _files_intact(ckpt: Path) -> bool:
    try:
        verify_checkpoint_files(ckpt)
    except CheckpointError:
        return False
    return (Path(ckpt) / METADATA_FILE).is_file()
