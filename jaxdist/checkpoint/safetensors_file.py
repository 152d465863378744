"""Safetensors files read and written with numpy, bfloat16 and float8 included.

The `safetensors` package's numpy API refuses bfloat16 (numpy has no such type), and published
models are mostly stored in it; its other APIs hand tensors to torch or to a JAX device. The format
is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and the bytes:
here a tensor is read alone, into memory of its own that goes when the caller drops it (a mapped
file would keep every page read so far counted against the process), and its numpy dtype comes
from ml_dtypes (which JAX ships) where numpy lacks it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

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


class File:
    """One safetensors file's tensors by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{self.path.name}: too short for a safetensors file")
            (size,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(size))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise SafetensorsError(f"{self.path.name}: its header is not JSON") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict = header
        self._start = 8 + size
        self._size = self.path.stat().st_size

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor `name`, read from the file."""
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path.name}: {name} has dtype {entry['dtype']}, which jaxdist does not read")
        begin, end = (self._start + offset for offset in entry["data_offsets"])
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        if end - begin != dtype.itemsize * int(np.prod(shape)) or end > self._size:
            raise SafetensorsError(f"{self.path.name}: {name}'s bytes do not match its shape {shape} (a truncated file?)")
        return np.fromfile(self.path, dtype, count=int(np.prod(shape)), offset=begin).reshape(shape)


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
