"""Tokenizers: raw UTF-8 bytes, or a SentencePiece BPE model trained locally on the user's files.

Nothing is downloaded: the byte tokenizer needs no model, and the SentencePiece model is trained
by `jaxdist data prepare` on the same documents it tokenizes and stored beside the shards.
Every tokenizer has a `separator` id, written after each document when documents are packed.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxdist.data import corpus
from jaxdist.errors import UserError

SENTENCEPIECE_FILE = "tokenizer.model"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    separator: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocab 256); NUL separates documents, as in the stdlib corpus."""

    name = "byte"
    vocab_size = 256
    separator = corpus.SEPARATOR

    def encode(self, text: str) -> np.ndarray:
        return corpus.encode(text)

    def decode(self, ids: np.ndarray) -> str:
        return corpus.decode(ids)


class SentencePieceTokenizer:
    """A SentencePiece model; its end-of-sequence id separates documents."""

    name = "sentencepiece"

    def __init__(self, model_proto: bytes):
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.vocab_size = self._processor.vocab_size()
        self.separator = self._processor.eos_id()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text), np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self._processor.decode([int(i) for i in ids])


TOKENIZERS = ("byte", "sentencepiece")


def check_name(name: str, key: str) -> None:
    """A `UserError` naming `key` unless `name` is a known tokenizer."""
    if name not in TOKENIZERS:
        raise UserError(f"{key}={name!r} is not a known tokenizer; choose one of {', '.join(TOKENIZERS)}")


def train(name: str, documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """The tokenizer `name`, trained on `documents` where it has anything to learn."""
    check_name(name, "tokenizer")
    if name == "byte":
        return ByteTokenizer()
    import sentencepiece

    # A bad input file raises inside sentencepiece's C++ loop, which would report it as its own
    # failure: stop the iteration there and raise the file's error afterwards instead.
    input_errors: list[UserError] = []

    def checked_documents() -> Iterator[str]:
        try:
            yield from documents
        except UserError as err:
            input_errors.append(err)

    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=checked_documents(), model_writer=model, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True,  # any text encodes, even characters never seen
            # Identity normalization keeps whitespace and newlines, so decode(encode(text)) == text.
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, max_sentence_length=1 << 24,
            unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, num_threads=2, minloglevel=2,
        )
    except RuntimeError as err:
        if input_errors:
            raise input_errors[0] from None
        raise UserError(
            f"data prepare: --vocab-size={vocab_size}: sentencepiece could not train on these files "
            f"({str(err).strip().splitlines()[-1]}); use a smaller vocabulary or more text"
        ) from None
    if input_errors:
        raise input_errors[0]
    return SentencePieceTokenizer(model.getvalue())


def save(tokenizer: Tokenizer, directory: Path) -> dict:
    """Writes what is needed to rebuild `tokenizer` into `directory`; returns its manifest entry."""
    entry = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator}
    if isinstance(tokenizer, SentencePieceTokenizer):
        (directory / SENTENCEPIECE_FILE).write_bytes(tokenizer.model_proto)
        entry["file"] = SENTENCEPIECE_FILE
    return entry


def load(entry: dict, directory: Path) -> Tokenizer:
    """The tokenizer a manifest entry describes (the inverse of `save`)."""
    check_name(entry.get("name"), f"data.path={directory}: the manifest's tokenizer")
    if entry["name"] == "byte":
        return ByteTokenizer()
    path = directory / entry["file"]
    if not path.is_file():
        raise UserError(f"data.path={directory}: tokenizer file {path.name} is missing; prepare the data again")
    return SentencePieceTokenizer(path.read_bytes())
