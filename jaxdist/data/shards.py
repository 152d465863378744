"""ArrayRecord shard files of one split: written in numbered turns, read back by record index.

A split is `SPLIT-00000.array_record`, `SPLIT-00001.array_record`, ... of at most
`records_per_shard` records each; the manifest lists the files and their record counts. Reading
checks both, so a missing, truncated or corrupt shard is a `UserError` naming it. `new_directory`
writes a prepared directory in full or not at all, and deletes only the scratch folder it made.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from jaxdist.errors import UserError, check_writable

# One record per chunk (group_size:1) keeps random access to a record cheap; zstd:1 decodes fast.
WRITER_OPTIONS = "group_size:1,zstd:1"
# The file that marks a scratch directory as made by `new_directory` (see there).
SCRATCH_MARKER = ".jaxdist-partial"


def first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@contextlib.contextmanager
def new_directory(out: str) -> Iterator[Path]:
    """A scratch directory, `NAME.partial` beside `out`, that becomes `out` when the block completes;
    on any error it is removed and `out` is left as it was. `out` must be new or empty.

    The scratch directory holds a marker file (`SCRATCH_MARKER`) from the moment it is made: one a
    killed prepare left is removed, but a `NAME.partial` jaxdist did not make (no marker, and not
    empty) is the user's, and a `UserError`: jaxdist deletes only what it made."""
    directory = Path(out)
    # "", ".", "/" and "a/.." name no folder of their own, to be built beside it as `NAME.partial`.
    if directory.name in ("", ".."):
        raise UserError(f"data prepare: --out={out!r} names no new directory; pass one, e.g. --out data/prepared")
    if directory.exists() and not directory.is_dir():
        raise UserError(f"data prepare: --out={out} is a file; pass a new or empty directory")
    if directory.is_dir() and any(directory.iterdir()):
        raise UserError(f"data prepare: --out={out} is not empty; pass a new or empty directory")
    scratch = directory.with_name(directory.name + ".partial")
    if _made_here(scratch):
        shutil.rmtree(scratch)
    elif os.path.lexists(scratch) and not _empty_folder(scratch):
        raise UserError(f"data prepare: --out={out}: {scratch} is in the way, and jaxdist did not make it (a prepare "
                        f"writes there before renaming it to the output); move it away or pass another --out")
    check_writable(scratch, f"data prepare: --out={out}", directory=True)  # creates it
    (scratch / SCRATCH_MARKER).touch()
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if directory.exists():
        directory.rmdir()
    scratch.rename(directory)
    (directory / SCRATCH_MARKER).unlink()


def _made_here(scratch: Path) -> bool:
    """Whether `scratch` is a scratch directory `new_directory` made (its marker inside; never a link)."""
    return not scratch.is_symlink() and scratch.is_dir() and (scratch / SCRATCH_MARKER).is_file()


def _empty_folder(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir() and not any(path.iterdir())


class RecordWriter:
    """Writes one split's records in order into numbered shard files of `records_per_shard` records."""

    def __init__(self, directory: Path, split: str, records_per_shard: int):
        self.directory, self.split, self.records_per_shard = directory, split, records_per_shard
        self.files: list[str] = []
        self.records: list[int] = []
        self._writer: ArrayRecordWriter | None = None

    def write(self, record: bytes) -> None:
        if self._writer is None or self.records[-1] == self.records_per_shard:
            if self._writer is not None:
                self._writer.close()
            name = f"{self.split}-{len(self.files):05d}.array_record"
            self._writer = ArrayRecordWriter(str(self.directory / name), WRITER_OPTIONS)
            self.files.append(name)
            self.records.append(0)
        self._writer.write(record)
        self.records[-1] += 1

    def close(self) -> dict:
        """Closes the last shard; returns the split's `files` and their `records` for the manifest."""
        if self._writer is not None:
            self._writer.close()
        return {"files": self.files, "records": self.records}


class RecordReader:
    """One split's records by index across its shards, as the manifest's `files` and `records` list them."""

    def __init__(self, directory: Path, files: list[str], records: list[int]):
        self.directory = directory
        self._names = list(files)
        self._shards = [self._open(name, count) for name, count in zip(self._names, records)]
        self._ends = [int(end) for end in np.cumsum(records)]

    def _open(self, name: str, expected: int):
        path = self.directory / name
        if not path.is_file():
            raise UserError(f"data.path={self.directory}: shard {name} is missing; prepare the data again")
        try:
            shard = grain.sources.ArrayRecordDataSource(str(path))
        except RuntimeError as err:
            raise UserError(
                f"data.path={self.directory}: shard {name} is corrupt ({first_line(err)}); prepare the data again"
            ) from None
        if len(shard) != expected:
            raise UserError(
                f"data.path={self.directory}: shard {name} has {len(shard)} records, the manifest says "
                f"{expected}; prepare the data again"
            )
        return shard

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def read(self, index: int, expected_bytes: int) -> bytes:
        """Record `index`; a `UserError` naming its shard if it is corrupt or not `expected_bytes` long."""
        shard = bisect.bisect_right(self._ends, index)
        position = index - (self._ends[shard - 1] if shard else 0)
        try:
            raw = self._shards[shard][position]
        except RuntimeError as err:
            raise UserError(
                f"data.path={self.directory}: record {position} of shard {self._names[shard]} is corrupt "
                f"({first_line(err)}); prepare the data again"
            ) from None
        if len(raw) != expected_bytes:
            raise UserError(
                f"data.path={self.directory}: record {position} of shard {self._names[shard]} holds "
                f"{len(raw)} bytes, not {expected_bytes}; prepare the data again"
            )
        return raw
