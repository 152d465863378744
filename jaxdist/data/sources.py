"""Random-access data sources for grain: prepared ArrayRecord shards and in-memory arrays.

A source has `__len__` and `__getitem__`, so grain can shuffle, shard and batch it by index.
`ArrayRecordTokens` is a token stream that slices like a numpy array, so the same
`pipeline.TokenWindows` packs windows from it as from the in-memory stdlib corpus;
`ArrayRecordImages` yields labeled images, one record each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import pydantic

from jaxdist.data.shards import RecordReader, first_line
from jaxdist.errors import UserError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "jaxdist-packed-tokens/1"
IMAGES_MANIFEST_FORMAT = "jaxdist-labeled-images/1"
# The `data.source` that reads each manifest format.
SOURCE_OF_FORMAT = {MANIFEST_FORMAT: "arrayrecord", IMAGES_MANIFEST_FORMAT: "images"}
# An image record: the label, then the pixels.
LABEL_DTYPE = np.dtype("<i4")
# What the loader reads of each format's manifest, with its type: a manifest that was edited or cut
# short is one line naming the key and its value, never a traceback (other keys are not read).
_Count = Annotated[int, pydantic.Field(ge=0)]
_Size = Annotated[int, pydantic.Field(gt=0)]


class _Split(pydantic.BaseModel, strict=True):
    files: list[str]
    records: list[_Count]


class _TokenSplit(_Split):
    tokens: _Count


class _ImageSplit(_Split):
    examples: _Count


class _Tokenizer(pydantic.BaseModel, strict=True):
    name: str
    vocab_size: _Size


class _TokensManifest(pydantic.BaseModel, strict=True):
    tokenizer: _Tokenizer
    dtype: Literal["uint8", "uint16", "uint32"]  # what `data prepare` writes (prepare.token_dtype)
    chunk_tokens: _Size
    splits: dict[Literal["train", "eval"], _TokenSplit]


class _ImagesManifest(pydantic.BaseModel, strict=True):
    classes: dict[str, _Count]
    image_shape: Annotated[list[_Size], pydantic.Field(min_length=3, max_length=3)]  # height, width, channels
    splits: dict[Literal["train", "eval"], _ImageSplit]


_SCHEMAS = {MANIFEST_FORMAT: _TokensManifest, IMAGES_MANIFEST_FORMAT: _ImagesManifest}


def read_manifest(directory: Path, expected: str = MANIFEST_FORMAT) -> dict:
    """The manifest `jaxdist data prepare` wrote into `directory` (the config's `data.path`), which
    must be of the `expected` format."""
    if directory.is_file() and directory.suffix == ".npz":
        raise UserError(f"data.path={directory} is an .npz file, which data.source=arrays reads; set data.source=arrays")
    if directory.is_file():
        raise UserError(f"data.path={directory} is a file, not a prepared directory; run `jaxdist data prepare "
                        f"{directory} --out DIR` and set data.path=DIR")
    if not directory.is_dir():
        raise UserError(
            f"data.path={directory} is not a directory; run `jaxdist data prepare INPUTS --out {directory}` first"
        )
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(
            f"data.path={directory} has no {MANIFEST}; point it at a directory written by `jaxdist data prepare`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"data.path={directory}: {MANIFEST} is corrupt ({first_line(err)}); prepare the data again") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != expected and found in SOURCE_OF_FORMAT:
        raise UserError(
            f"data.path={directory} holds {found} data, which data.source={SOURCE_OF_FORMAT[found]} reads, not "
            f"data.source={SOURCE_OF_FORMAT[expected]}; set data.source={SOURCE_OF_FORMAT[found]}"
        )
    if found != expected:
        raise UserError(
            f"data.path={directory}: {MANIFEST} is not a {expected} manifest; prepare the data again"
        )
    problem = _manifest_problem(manifest, _SCHEMAS[expected])
    if problem is not None:
        raise UserError(f"data.path={directory}: {MANIFEST}{problem}; prepare the data again")
    return manifest


def _manifest_problem(manifest: dict, schema: type[pydantic.BaseModel]) -> str | None:
    """What is wrong with a manifest's first wrong value, as words (None: every value read is sound)."""
    try:
        read = schema.model_validate(manifest)
    except pydantic.ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(map(str, problem["loc"]))
        if problem["type"] == "missing":
            return f" lacks the key {where}"
        return f": {where}={problem['input']!r}: {problem['msg']}"
    for split, entry in read.splits.items():
        for index, name in enumerate(entry.files):
            if name in ("", ".", "..") or Path(name).name != name:  # read from the folder, never outside it
                return f": splits.{split}.files.{index}={name!r}: a shard is a file name in the folder, not a path"
        if len(entry.files) != len(entry.records):
            return f": splits.{split}: lists {len(entry.files)} file(s) but {len(entry.records)} record count(s)"
    return None


def prepared_source(directory: Path) -> str | None:
    """The data.source that reads `directory`, where `jaxdist data prepare` wrote it; else None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):  # none, or not JSON (ValueError: JSONDecodeError, UnicodeDecodeError)
        return None
    return SOURCE_OF_FORMAT.get(manifest.get("format")) if isinstance(manifest, dict) else None


class ArrayRecordTokens:
    """One split's packed token stream, read by range (`tokens[a:b]`) from its ArrayRecord shards.

    Record r holds tokens [r * chunk_tokens, (r + 1) * chunk_tokens) of the stream; only the last
    record may be shorter. Opening checks every shard's record count against the manifest, and a
    record that fails its checksum when read raises a `UserError` naming the shard.
    """

    def __init__(self, directory: Path, manifest: dict, split: str):
        entry = manifest["splits"][split]
        self._records = RecordReader(directory, entry["files"], entry["records"])
        self._chunk = int(manifest["chunk_tokens"])
        self._dtype = np.dtype(manifest["dtype"])
        self._length = int(entry["tokens"])
        if len(self._records) != -(-self._length // self._chunk):
            raise UserError(
                f"data.path={directory}: the {split} split has {len(self._records)} records for {self._length} "
                f"tokens; {MANIFEST} does not match the shards, prepare the data again"
            )

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
        expected = min(self._chunk, self._length - index * self._chunk) * self._dtype.itemsize
        return np.frombuffer(self._records.read(index, expected), self._dtype)


class ArrayRecordImages:
    """One split's labeled images from the shards `jaxdist data prepare FOLDER` wrote.

    `source[i] == {"images": uint8 [H, W, C], "labels": int32 []}`. A record is the label (int32,
    little-endian) followed by the uint8 pixels in H, W, C order. The pixels stay 8-bit on the way
    to the device (a quarter of float32's bytes to augment, batch, pass between processes and
    copy to the device); the classifier scales them to [0, 1] there (`models.classifier`).
    """

    def __init__(self, directory: Path, manifest: dict, split: str):
        entry = manifest["splits"][split]
        self._records = RecordReader(directory, entry["files"], entry["records"])
        self.image_shape = tuple(int(size) for size in manifest["image_shape"])
        self._bytes = LABEL_DTYPE.itemsize + int(np.prod(self.image_shape))
        if len(self._records) != entry["examples"]:
            raise UserError(
                f"data.path={directory}: the {split} split has {len(self._records)} records for "
                f"{entry['examples']} examples; {MANIFEST} does not match the shards, prepare the data again"
            )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        raw = self._records.read(index, self._bytes)
        label = np.frombuffer(raw, LABEL_DTYPE, count=1)[0].astype(np.int32)
        pixels = np.frombuffer(raw, np.uint8, offset=LABEL_DTYPE.itemsize).reshape(self.image_shape)
        return {"images": pixels, "labels": label}


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
