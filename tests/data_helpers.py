"""Small datasets for the data tests: random documents on disk, prepared into ArrayRecord shards."""

from __future__ import annotations

import numpy as np

from jaxdist.data import prepare

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz  \n"))


def random_documents(count: int, seed: int = 0, shortest: int = 40, longest: int = 400) -> list[str]:
    """`count` documents of random letters: every 17-token window of them is unique in practice."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(LETTERS, rng.integers(shortest, longest))) for _ in range(count)]


def write_text_files(directory, docs: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(docs):
        (directory / f"doc{index:03d}.txt").write_text(text)


def prepared(tmp_path, docs: list[str], **options) -> tuple:
    """(shard directory, manifest) of `docs` written as text files and prepared with `options`."""
    write_text_files(tmp_path / "docs", docs)
    out = tmp_path / "shards"
    manifest = prepare.prepare([str(tmp_path / "docs")], str(out), **options)
    return out, manifest


def window_ids(batches: list[dict], index_of: dict[bytes, int]) -> list[int]:
    """The window index of every row of `batches` (rows looked up by their input tokens)."""
    return [index_of[row.tobytes()] for batch in batches for row in batch["inputs"]]


def huggingface_tokenizer(path, docs: list[str], vocab_size: int = 300, special: tuple[str, ...] = ("<|endoftext|>",)):
    """A byte-level BPE tokenizer.json trained on `docs` with the `tokenizers` library; returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen or not
    )
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(path))
    return path
