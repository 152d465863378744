"""Random-access data sources for grain: prepared ArrayRecord token shards and in-memory arrays.

A source has `__len__` and `__getitem__`, so grain can shuffle, shard and batch it by index.
`ArrayRecordTokens` is a token stream that slices like a numpy array, so the same
`pipeline.TokenWindows` packs windows from it as from the in-memory stdlib corpus.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from pathlib import Path

import grain
import numpy as np

from jaxdist.errors import UserError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "jaxdist-packed-tokens/1"


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def read_manifest(directory: Path) -> dict:
    """The manifest `jaxdist data prepare` wrote into `directory` (the config's `data.path`)."""
    if not directory.is_dir():
        raise UserError(
            f"data.path={directory} is not a directory; run `jaxdist data prepare FILES --out {directory}` first"
        )
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(
            f"data.path={directory} has no {MANIFEST}; point it at a directory written by `jaxdist data prepare`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"data.path={directory}: {MANIFEST} is corrupt ({_first_line(err)}); prepare the data again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise UserError(
            f"data.path={directory}: {MANIFEST} is not a {MANIFEST_FORMAT} manifest; prepare the data again"
        )
    return manifest


class ArrayRecordTokens:
    """One split's packed token stream, read by range (`tokens[a:b]`) from its ArrayRecord shards.

    Record r holds tokens [r * chunk_tokens, (r + 1) * chunk_tokens) of the stream; only the last
    record may be shorter. Opening checks every shard's record count against the manifest, and a
    record that fails its checksum when read raises a `UserError` naming the shard.
    """

    def __init__(self, directory: Path, manifest: dict, split: str):
        entry = manifest["splits"][split]
        self.directory = directory
        self._names = list(entry["files"])
        self._shards = [self._open(name, count) for name, count in zip(self._names, entry["records"])]
        self._ends = list(np.cumsum(entry["records"]))
        self._chunk = int(manifest["chunk_tokens"])
        self._dtype = np.dtype(manifest["dtype"])
        self._length = int(entry["tokens"])
        records = self._ends[-1] if self._ends else 0
        if records != -(-self._length // self._chunk):
            raise UserError(
                f"data.path={directory}: the {split} split has {records} records for {self._length} tokens; "
                f"{MANIFEST} does not match the shards, prepare the data again"
            )

    def _open(self, name: str, expected: int):
        path = self.directory / name
        if not path.is_file():
            raise UserError(f"data.path={self.directory}: shard {name} is missing; prepare the data again")
        try:
            shard = grain.sources.ArrayRecordDataSource(str(path))
        except RuntimeError as err:
            raise UserError(
                f"data.path={self.directory}: shard {name} is corrupt ({_first_line(err)}); prepare the data again"
            ) from None
        if len(shard) != expected:
            raise UserError(
                f"data.path={self.directory}: shard {name} has {len(shard)} records, the manifest says "
                f"{expected}; prepare the data again"
            )
        return shard

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self._length)
        if stop <= start:
            return np.zeros(0, self._dtype)
        first, last = start // self._chunk, (stop - 1) // self._chunk
        parts = [self._record(index) for index in range(first, last + 1)]
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        offset = start - first * self._chunk
        return tokens[offset : offset + stop - start]

    def _record(self, index: int) -> np.ndarray:
        shard = bisect.bisect_right(self._ends, index)
        position = index - (self._ends[shard - 1] if shard else 0)
        expected = min(self._chunk, self._length - index * self._chunk) * self._dtype.itemsize
        try:
            raw = self._shards[shard][position]
        except RuntimeError as err:
            raise UserError(
                f"data.path={self.directory}: record {position} of shard {self._names[shard]} is corrupt "
                f"({_first_line(err)}); prepare the data again"
            ) from None
        if len(raw) != expected:
            raise UserError(
                f"data.path={self.directory}: record {position} of shard {self._names[shard]} holds "
                f"{len(raw)} bytes, not {expected}; prepare the data again"
            )
        return np.frombuffer(raw, self._dtype)


class ArraySource:
    """Rows of equally long in-memory arrays as examples: `source[i] == {name: array[i], ...}`.

    For classifiers and tests: e.g. `ArraySource({"image": x, "label": y})`, or
    `{"inputs": ..., "targets": ...}` token rows for a language model.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], name: str = "in-memory arrays"):
        self.arrays = {key: np.asarray(array) for key, array in arrays.items()}
        lengths = {key: array.shape[0] if array.ndim else 0 for key, array in self.arrays.items()}
        if not lengths or len(set(lengths.values())) != 1 or not min(lengths.values()):
            raise UserError(f"{name}: need one or more non-empty arrays of equal length, got lengths {lengths}")
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {name: array[index] for name, array in self.arrays.items()}
