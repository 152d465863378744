"""Safetensors files read and written with numpy, bfloat16 and float8 included.

The `safetensors` package's numpy API refuses bfloat16 (numpy has no such type), and published
models are mostly stored in it; its other APIs hand tensors to torch or to a JAX device. The format
is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and the bytes:
here a tensor is read alone, into memory of its own that goes when the caller drops it (a mapped
file would keep every page read so far counted against the process), and its numpy dtype comes
from ml_dtypes (which JAX ships) where numpy lacks it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file."""


# The format's own bound on the header (the safetensors package refuses longer ones).
MAX_HEADER_BYTES = 100_000_000


class File:
    """One safetensors file's tensors by name. Its header is checked whole when the file is opened
    (`header_entries`): nothing is read from a file whose header does not describe its bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{self.path.name}: too short for a safetensors file")
            (size,) = struct.unpack("<Q", head)
            if size > self._size - 8:
                raise SafetensorsError(f"{self.path.name}: its header claims {size:,} bytes, more than the "
                                       f"{self._size - 8:,} after its length: the file is cut short, or no "
                                       f"safetensors file")
            if size > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{self.path.name}: its header of {size:,} bytes is longer than the format "
                                       f"allows ({MAX_HEADER_BYTES:,})")
            try:
                header = json.loads(f.read(size))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise SafetensorsError(f"{self.path.name}: its header is not JSON") from None
        self._start = 8 + size
        self.metadata, self._entries = header_entries(header, self._size - self._start, self.path.name)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def get(self, name: str) -> np.ndarray:
        """The tensor `name`, read from the file."""
        entry = self._entries[name]
        if entry.dtype not in DTYPES:
            raise SafetensorsError(f"{self.path.name}: {name} has dtype {entry.dtype}, which jaxdist does not read")
        count = math.prod(entry.shape)
        return np.fromfile(self.path, DTYPES[entry.dtype], count=count, offset=self._start + entry.begin).reshape(
            entry.shape)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A tensor as the header describes it: dtype name, shape, and its bytes [begin, end) of the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header_entries(header: Any, data_bytes: int, name: str) -> tuple[dict[str, str], dict[str, Entry]]:
    """The metadata and the tensor entries of a decoded header, each checked against the `data_bytes`
    after it: a `SafetensorsError` for any value of the wrong type, offsets outside the data, or a
    span that is not its shape times its dtype's size (for the dtypes jaxdist reads)."""
    if not isinstance(header, dict):
        raise SafetensorsError(f"{name}: its header is not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{name}: its __metadata__ is not an object of strings")
    entries = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{name}: the header's entry {key!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise SafetensorsError(f"{name}: {key}'s dtype {dtype!r} is not a name such as F32")
        if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
            raise SafetensorsError(f"{name}: {key}'s shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)
                and offsets[0] <= offsets[1] <= data_bytes):
            raise SafetensorsError(f"{name}: {key}'s data_offsets {offsets!r} are not two integers within its "
                                   f"{data_bytes:,} bytes of data")
        span, wanted = offsets[1] - offsets[0], math.prod(shape) * DTYPES[dtype].itemsize if dtype in DTYPES else None
        if wanted is not None and span != wanted:
            raise SafetensorsError(f"{name}: {key} holds {span:,} bytes, not the {wanted:,} of its shape {shape} in "
                                   f"{dtype}")
        entries[key] = Entry(dtype, tuple(shape), *offsets)
    return metadata, entries


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes `tensors` (C order, dtypes of `DTYPES`) as one safetensors file, in name order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        array = tensors[name]
        if array.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {array.dtype} has no safetensors name")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the format's writers do
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
