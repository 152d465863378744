"""`jaxdist data prepare`: text, JSONL or Parquet files -> packed token ArrayRecord shards (an image
folder goes to `jaxdist.data.images` instead).

Each document is tokenized and followed by the tokenizer's separator; the documents of a split
are concatenated into one token stream, cut into records of `chunk_tokens` tokens (only the
split's last record may be shorter) and written to ArrayRecord shards. A stable hash of
(file, document index) puts about `eval_fraction` of the documents in the eval split; a corpus of
two or more documents with `eval_fraction` > 0 holds out at least one. The `manifest.json` beside
the shards records the tokenizer, the dtype and every count.

Input formats, by file name (any case): `.jsonl`, `.ndjson` or `.json` (one JSON object per line,
text under `text_key`), `.parquet` (the `text_key` column, of strings or UTF-8 binary), anything
else is UTF-8 text, one document per file. Directories are searched recursively.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxdist import atomic
from jaxdist.data import images, shards, sources
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.errors import UserError, optional_import, warn

SPLITS = ("train", "eval")
# Parquet column types read as UTF-8 text (binary too: Impala and Hive write text without the UTF-8
# annotation). Type names, as pyarrow's type tests for the views are recent.
PARQUET_TEXT = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")
# Some editors start a UTF-8 file with it; it is no part of the text.
BYTE_ORDER_MARK = "\ufeff"
# Most .json corpora are JSON lines; a JSON array file is refused with a line saying so.
JSON_LINES = (".jsonl", ".ndjson", ".json")


def input_files(paths: list[str]) -> list[tuple[Path, str]]:
    """(file, stable name) for every input file, directories expanded recursively.

    Directories are listed sorted, skipping hidden and empty files (an empty file named on its
    own is an error) and images (a text corpus's logos and figures; a warning counts them). The
    name (relative to the directory named; a file named on its own by its base name) decides a
    document's split, so moving the data keeps the split. Files that would share a name are told
    apart by their folders (`_distinct_names`); a file given twice is an error.
    """
    files: list[tuple[Path, str]] = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise UserError(f"data prepare: input {name} does not exist; pass existing files or directories")
        if path.is_dir():
            found = sorted(
                p.relative_to(path) for p in path.rglob("*")
                if p.is_file() and p.stat().st_size
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise UserError(f"data prepare: directory {name} holds no non-empty files; pass one with text files, "
                                f"or with a subfolder of images per class")
            skipped = [relative for relative in found if images.is_image(relative)]
            if skipped:
                warn(f"data prepare: skipped {len(skipped)} image file(s) in {name} (the first: {skipped[0]}); "
                     f"the text files beside them are prepared")
            files.extend((path / relative, relative.as_posix()) for relative in found if not images.is_image(relative))
        else:
            files.append((path, path.name))
    return _distinct_names(files)


def _distinct_names(files: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """`files` with every name that several files share lengthened by their parent folders, one at
    a time, until no two files share one: en/train.txt and de/train.txt rather than two train.txt,
    which would share every document's split.

    Only names that collide change, so the splits of other inputs stay as they were; and folder
    names, not whole paths, so rerunning the command from anywhere, or on the data moved, keeps
    the splits.
    """
    real = [path.resolve() for path, _ in files]
    first: dict[Path, Path] = {}
    for (path, _), resolved in zip(files, real):
        if resolved in first:
            raise UserError(f"data prepare: {path} is given twice (also as {first[resolved]}); pass each file once")
        first[resolved] = path
    names = [name for _, name in files]
    while True:
        counts = Counter(names)
        clashing = [index for index, name in enumerate(names) if counts[name] > 1]
        if not clashing:
            return [(path, name) for (path, _), name in zip(files, names)]
        for index in clashing:
            # The files' real paths differ, so at worst the whole path tells them apart.
            parts = real[index].parts
            names[index] = Path(*parts[-min(len(Path(names[index]).parts) + 1, len(parts)):]).as_posix()


def documents(path: Path, text_key: str) -> Iterator[str]:
    """The documents of one input file; a `UserError` names the file (and line) of any bad input."""
    if path.stat().st_size == 0:
        raise UserError(f"data prepare: {path} is empty; remove it from the inputs or give it some text")
    suffix = path.suffix.lower()
    reader = _parquet_documents if suffix == ".parquet" else _jsonl_documents if suffix in JSON_LINES else _text_document
    count = 0
    for text in reader(path, text_key):
        count += 1
        yield text
    if not count:
        raise UserError(f"data prepare: {path} holds no documents; remove it from the inputs or add text")


def _text_document(path: Path, text_key: str) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"data prepare: {path} is not UTF-8 text (byte {err.start}); convert it or leave it out") from None
    yield text.removeprefix(BYTE_ORDER_MARK)


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    advice = ("a .json input must hold one JSON object per line: fix that line, or convert a JSON array file to "
              "JSON lines" if path.suffix.lower() == ".json" else "fix or drop that line")
    # Bytes, decoded line by line: a text-mode file decodes ahead of the line it returns, so its
    # error would name a line before the bad byte.
    with open(path, "rb") as lines:
        for number, data in enumerate(lines, 1):
            try:
                # Every line's mark goes: files that each began with one may have been concatenated.
                line = data.decode("utf-8").removeprefix(BYTE_ORDER_MARK)
            except UnicodeDecodeError as err:
                raise UserError(f"data prepare: {path}:{number} is not UTF-8 text (byte {err.start} of the line); "
                                f"convert the file or leave it out") from None
            if line.strip():
                yield _jsonl_text(line, f"{path}:{number}", text_key, advice)


def _jsonl_text(line: str, where: str, text_key: str, advice: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"data prepare: {where} is not valid JSON ({err.msg}); {advice}") from None
    if not isinstance(record, dict):
        raise UserError(f"data prepare: {where} is not a JSON object; {advice}")
    text = record.get(text_key)
    if not isinstance(text, str):
        raise UserError(f"data prepare: {where} has no string field {text_key!r}; pass --text-key with the field that holds the text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a JSON escape of half a character, such as "\ud83d"
        raise UserError(f"data prepare: {where} is not UTF-8 text: field {text_key!r} holds the lone surrogate "
                        f"\\u{ord(text[err.start]):04x}; fix or drop that line") from None
    return text


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    pa = optional_import("pyarrow", "parquet", f"data prepare: reading {path}")
    pq = optional_import("pyarrow.parquet", "parquet", f"data prepare: reading {path}")

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"data prepare: {path} is not a readable Parquet file ({err}); re-export it") from None
    if text_key not in table.schema_arrow.names:
        raise UserError(
            f"data prepare: {path} has no column {text_key!r} (columns: {', '.join(table.schema_arrow.names)}); "
            f"pass --text-key"
        )
    kind = table.schema_arrow.field(text_key).type
    if str(kind.value_type if pa.types.is_dictionary(kind) else kind) not in PARQUET_TEXT:
        raise UserError(f"data prepare: {path} column {text_key!r} holds {kind}, not text; pass --text-key with a "
                        f"string column, or convert that column to strings")
    row = 0
    for batch in table.iter_batches(columns=[text_key]):
        # As bytes, decoded here: a string that is not UTF-8 (Arrow does not check on write) names its row.
        for data in batch.column(0).cast(pa.large_binary()).to_pylist():
            if data is not None:
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise UserError(f"data prepare: {path} row index {row} of column {text_key!r} is not UTF-8 text "
                                    f"(byte {err.start}); fix or drop that row") from None
                yield text
            row += 1


def _document_hash(name: str, index: int) -> int:
    return zlib.crc32(f"{name}#{index}".encode())


def split_of(name: str, index: int, eval_fraction: float) -> str:
    """'eval' for about `eval_fraction` of documents, chosen by a stable hash of (file name, index)."""
    return "eval" if _document_hash(name, index) < int(eval_fraction * 2**32) else "train"


def forced_eval_document(files: list[tuple[Path, str]], text_key: str, eval_fraction: float) -> tuple[str, int] | None:
    """(file name, index) of the document to hold out when the hash split would hold out none.

    That is the document with the smallest hash, so the choice is stable; None when the hash split
    holds one out already, `eval_fraction` is 0 or there are fewer than two documents. Reading
    stops at the first document the hash split holds out, so a large corpus is barely read.
    """
    if not eval_fraction:
        return None
    smallest: tuple[int, str, int] | None = None
    count = 0
    for path, name in files:
        for index, _ in enumerate(documents(path, text_key)):
            if split_of(name, index, eval_fraction) == "eval":
                return None
            count += 1
            key = (_document_hash(name, index), name, index)
            smallest = key if smallest is None else min(smallest, key)
    return smallest[1:] if count >= 2 else None


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below `vocab_size`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise UserError(f"vocabulary of {vocab_size} ids does not fit 32 bits")


class ShardWriter:
    """Packs one split's documents into fixed-size token records across numbered shard files."""

    def __init__(self, directory: Path, split: str, chunk_tokens: int, records_per_shard: int, dtype: np.dtype):
        self.chunk_tokens, self.dtype = chunk_tokens, dtype
        self.tokens = 0
        self.documents = 0
        self.longest_document = 0
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._records = shards.RecordWriter(directory, split, records_per_shard)

    def add(self, ids: np.ndarray, separator: int) -> None:
        """Appends one document's ids and the separator after it."""
        ids = np.append(ids, separator).astype(self.dtype)
        self.documents += 1
        self.longest_document = max(self.longest_document, len(ids) - 1)
        self.tokens += len(ids)
        self._pending.append(ids)
        self._pending_tokens += len(ids)
        if self._pending_tokens >= self.chunk_tokens:
            stream = np.concatenate(self._pending)
            whole = len(stream) - len(stream) % self.chunk_tokens
            for start in range(0, whole, self.chunk_tokens):
                self._records.write(stream[start : start + self.chunk_tokens].tobytes())
            self._pending = [stream[whole:]]
            self._pending_tokens = len(stream) - whole

    def close(self) -> dict:
        """Writes the last (short) record and returns this split's manifest entry."""
        if self._pending_tokens:
            self._records.write(np.concatenate(self._pending).tobytes())
        return {
            **self._records.close(), "tokens": self.tokens,
            "documents": self.documents, "longest_document": self.longest_document,
        }


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str = "byte",
    vocab_size: int = 4096,
    eval_fraction: float = 0.01,
    chunk_tokens: int = 4096,
    records_per_shard: int = 4096,
    text_key: str = "text",
) -> dict:
    """Tokenizes `inputs` into packed ArrayRecord shards under `out`; returns the manifest."""
    tokenizer_lib.check_name(tokenizer, "data prepare: --tokenizer")
    if not 0 <= eval_fraction < 1:
        raise UserError(f"data prepare: --eval-fraction={eval_fraction} must be in [0, 1)")
    if chunk_tokens < 1 or records_per_shard < 1 or vocab_size < 1:
        raise UserError("data prepare: --chunk-tokens, --records-per-shard and --vocab-size must be positive")
    files = input_files(inputs)
    with shards.new_directory(out) as scratch:
        forced = forced_eval_document(files, text_key, eval_fraction)

        def all_documents() -> Iterator[tuple[str, str]]:
            for path, name in files:
                for index, text in enumerate(documents(path, text_key)):
                    yield "eval" if (name, index) == forced else split_of(name, index, eval_fraction), text

        train_texts = (text for split, text in all_documents() if split == "train")
        first = next(train_texts, None)
        if first is None:  # said now: sentencepiece would fail on it with an error of its own
            raise UserError(
                f"data prepare: every document fell into the eval split, leaving none to train on; lower "
                f"--eval-fraction={eval_fraction} or add documents"
            )
        tok = tokenizer_lib.train(tokenizer, itertools.chain([first], train_texts), vocab_size)
        dtype = token_dtype(tok.vocab_size)
        writers = {split: ShardWriter(scratch, split, chunk_tokens, records_per_shard, dtype) for split in SPLITS}
        for split, text in all_documents():
            writers[split].add(tok.encode(text), tok.separator)
        splits = {split: writer.close() for split, writer in writers.items()}
        manifest = {
            "format": sources.MANIFEST_FORMAT,
            "tokenizer": tokenizer_lib.save(tok, scratch),
            "dtype": dtype.name,
            "chunk_tokens": chunk_tokens,
            "eval_fraction": eval_fraction,
            "inputs": [str(path) for path, _ in files],
            "splits": splits,
        }
        atomic.write_text(scratch / sources.MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def summary(out: str, manifest: dict) -> str:
    """One line on what `prepare` wrote."""
    counts = ", ".join(
        f"{split} {entry['documents']} documents / {entry['tokens']} tokens"
        for split, entry in manifest["splits"].items()
    )
    return f"wrote {out}: {counts}; {manifest['tokenizer']['name']} tokenizer, vocab {manifest['tokenizer']['vocab_size']}"
