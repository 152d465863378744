"""`data.source: digits`: scikit-learn's bundled handwritten digits, a small real image dataset.

`sklearn.datasets.load_digits`: 1,797 grey 8x8 images of the digits 0-9 (UCI's optical
recognition of handwritten digits, test part), shipped inside scikit-learn, so nothing is
downloaded. Pixels (0 to 16) are scaled to [0, 1] as float32 [8, 8, 1]; labels are int32. The
split never changes: a permutation seeded 0 holds out its first 360 images for eval and leaves
1,437 for training (data.eval_fraction, which would change nothing, is refused).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxdist.errors import optional_import

EVAL_EXAMPLES = 360
CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


@functools.cache
def _all() -> tuple[np.ndarray, np.ndarray]:
    datasets = optional_import("sklearn.datasets", "digits", "data.source=digits")
    digits = datasets.load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return images, digits.target.astype(np.int32)


def split(name: str) -> dict[str, np.ndarray]:
    """The `images` and `labels` of the 'train' or 'eval' split, in a fixed order."""
    images, labels = _all()
    held_out = np.random.default_rng(0).permutation(len(labels))[:EVAL_EXAMPLES]
    chosen = np.sort(held_out) if name == "eval" else np.setdiff1d(np.arange(len(labels)), held_out)
    return {"images": images[chosen], "labels": labels[chosen]}
