"""Tokenizers: raw UTF-8 bytes, a SentencePiece BPE model trained locally on the user's files, or
an existing Hugging Face `tokenizers` file.

Nothing is downloaded: the byte tokenizer needs no model, the SentencePiece model is trained by
`jaxdist data prepare` on the same documents it tokenizes, and a Hugging Face tokenizer.json is
read from a local path; models are stored beside the shards. Every tokenizer has a `separator`
id, written after each document when documents are packed.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxdist.data import corpus
from jaxdist.errors import UserError, optional_import

SENTENCEPIECE_FILE = "tokenizer.model"
HUGGINGFACE_FILE = "tokenizer.json"
# End-of-text special tokens, in the order they are looked for in a Hugging Face tokenizer.
SEPARATOR_TOKENS = ("<|endoftext|>", "</s>", "[SEP]", "<eos>")
# SentencePiece skips longer documents when training.
MAX_SENTENCE_BYTES = 1 << 24


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
        # A NUL in the text would read as the separator, a false document boundary: it is dropped.
        return corpus.encode(text.replace("\0", ""))

    def decode(self, ids: np.ndarray) -> str:
        return corpus.decode(ids)


class SentencePieceTokenizer:
    """A SentencePiece model; its end-of-sequence id separates documents."""

    name = "sentencepiece"

    def __init__(self, model_proto: bytes):
        sentencepiece = optional_import("sentencepiece", "sentencepiece", "a SentencePiece tokenizer")
        self._processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.vocab_size = self._processor.vocab_size()
        self.separator = self._processor.eos_id()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._processor.encode(text), np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self._processor.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizers` file; its end-of-text special token separates documents.

    `source` names the file in errors. Encoding adds no special tokens (the separator is written
    between documents instead) and reads a special token written in the text, such as a literal
    `<|endoftext|>`, as plain text; decoding keeps them.
    """

    name = "huggingface"

    def __init__(self, config_json: str, source: str):
        try:
            import tokenizers
        except ImportError:
            raise UserError(
                f"{source}: reading a Hugging Face tokenizer needs the tokenizers package; "
                f"pip install 'jaxdist[tokenizers]'"
            ) from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(config_json)
        except Exception as err:  # the Rust library raises plain Exceptions
            raise UserError(f"{source} is not a Hugging Face tokenizer file ({str(err).strip()}); pass a tokenizer.json") from None
        # Otherwise a document quoting `<|endoftext|>` would encode it as the separator: a false document boundary.
        self._tokenizer.encode_special_tokens = True
        self.config_json = config_json
        # Added tokens may sit above the base vocabulary, with gaps: the largest id decides the size.
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        special = {token.content: id_ for id_, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        separator = next((special[token] for token in SEPARATOR_TOKENS if token in special), None)
        if separator is None:
            raise UserError(
                f"{source} has no end-of-text special token to separate documents; add one of "
                f"{', '.join(SEPARATOR_TOKENS)} as a special token"
            )
        self.separator = separator

    @classmethod
    def from_file(cls, path: Path) -> HuggingFaceTokenizer:
        """The tokenizer in the tokenizer.json at `path`."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"tokenizer {path} is not readable ({err}); pass a Hugging Face tokenizer.json") from None
        return cls(text, f"tokenizer {path}")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


TOKENIZERS = ("byte", "sentencepiece")
# The names a manifest records (a Hugging Face tokenizer is chosen by its file's path).
SAVED = (*TOKENIZERS, HuggingFaceTokenizer.name)


def check_name(name: str, key: str) -> None:
    """A `UserError` naming `key` unless `name` is a known tokenizer or an existing .json file."""
    if name in TOKENIZERS:
        return
    if name.endswith(".json"):
        if not Path(name).is_file():
            raise UserError(f"{key}={name} does not exist; pass the path of a Hugging Face tokenizer.json")
        return
    raise UserError(
        f"{key}={name!r} is not a known tokenizer; choose one of {', '.join(TOKENIZERS)} "
        f"or the path of a Hugging Face tokenizer .json file"
    )


def train(name: str, documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """The tokenizer `name`, trained on `documents` where it has anything to learn."""
    check_name(name, "tokenizer")
    if name == "byte":
        return ByteTokenizer()
    if name.endswith(".json"):
        return HuggingFaceTokenizer.from_file(Path(name))
    sentencepiece = optional_import("sentencepiece", "sentencepiece", "--tokenizer=sentencepiece")

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
            allow_whitespace_only_pieces=True, max_sentence_length=MAX_SENTENCE_BYTES,
            unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, num_threads=2, minloglevel=2,
        )
    except RuntimeError as err:
        if input_errors:
            raise input_errors[0] from None
        raise UserError(_training_error(vocab_size, str(err).strip().splitlines()[-1])) from None
    if input_errors:
        raise input_errors[0]
    return SentencePieceTokenizer(model.getvalue())


def _training_error(vocab_size: int, reason: str) -> str:
    """What to change when sentencepiece could not train a `vocab_size` vocabulary, for `reason`
    (its message): the sizes it names are the bounds to give; no text at all is not a size problem."""
    if "sentences_.empty()" in reason:
        return (f"data prepare: --tokenizer=sentencepiece: the train split's documents hold no text it can learn "
                f"from (each is empty or longer than {MAX_SENTENCE_BYTES} bytes); add text, or split long documents")
    prefix = f"data prepare: --vocab-size={vocab_size}"
    if match := re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason):
        return (f"{prefix} is too small: these files need {match[1]} pieces for their characters, bytes and "
                f"special ids; use --vocab-size={match[1]} or more")
    if match := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", reason):
        return (f"{prefix} is too large: these files hold enough text for at most {match[1]} pieces; use "
                f"--vocab-size={match[1]} or less, or more text")
    return f"{prefix}: sentencepiece could not train on these files ({reason}); change --vocab-size or add text"


def save(tokenizer: Tokenizer, directory: Path) -> dict:
    """Writes what is needed to rebuild `tokenizer` into `directory`; returns its manifest entry."""
    entry = {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator}
    if isinstance(tokenizer, SentencePieceTokenizer):
        (directory / SENTENCEPIECE_FILE).write_bytes(tokenizer.model_proto)
        entry["file"] = SENTENCEPIECE_FILE
    elif isinstance(tokenizer, HuggingFaceTokenizer):
        (directory / HUGGINGFACE_FILE).write_text(tokenizer.config_json, encoding="utf-8")
        entry["file"] = HUGGINGFACE_FILE
    return entry


def load(entry: dict, directory: Path) -> Tokenizer:
    """The tokenizer a manifest entry describes (the inverse of `save`)."""
    name = entry.get("name")
    if name not in SAVED:
        raise UserError(f"data.path={directory}: the manifest's tokenizer {name!r} is not one of {', '.join(SAVED)}; "
                        f"prepare the data again")
    if name == "byte":
        return ByteTokenizer()
    path = directory / entry["file"]
    if not path.is_file():
        raise UserError(f"data.path={directory}: tokenizer file {path.name} is missing; prepare the data again")
    try:
        if name == HuggingFaceTokenizer.name:
            return HuggingFaceTokenizer(path.read_text(encoding="utf-8"), f"data.path={directory}: {path.name}")
        return SentencePieceTokenizer(path.read_bytes())
    except (RuntimeError, UnicodeDecodeError):  # sentencepiece's parse error; a tokenizer.json not UTF-8
        raise UserError(f"data.path={directory}: tokenizer file {path.name} is corrupt (it does not load as a "
                        f"{name} tokenizer); prepare the data again") from None
