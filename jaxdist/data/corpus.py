"""The embedded default corpus: the Python standard library's own `.py` sources, as bytes.

Present on every machine with Python (about 30 MB of real text), so the default run needs no
download. Files are joined with a NUL byte (which Python sources never contain) as separator;
a stable hash of each file's path puts about `eval_fraction` of the files in the eval split.
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from jaxdist.errors import UserError

SEPARATOR = 0


@functools.cache
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path for path in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts)
    )
    if not files:
        raise UserError(f"data.source=stdlib: no .py files found under {root}")
    return files


@functools.cache
def stdlib_tokens(split: str, eval_fraction: float) -> np.ndarray:
    """The byte tokens (uint8) of the 'train' or 'eval' split of the standard-library corpus."""
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    cutoff = int(eval_fraction * 2**32)
    chosen = [
        path for path in files
        if (zlib.crc32(str(path.relative_to(root)).encode()) < cutoff) == (split == "eval")
    ]
    parts = []
    for path in chosen:
        parts.append(np.frombuffer(path.read_bytes(), np.uint8))
        parts.append(np.array([SEPARATOR], np.uint8))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def decode(tokens: np.ndarray) -> str:
    return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8)
