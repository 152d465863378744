"""Train-image augmentation: a random crop of the zero-padded image and a random left-right flip.

The randomness of an example is drawn from (seed, its global example index), the same number
that is the data position (`pipeline`): every process that reads the example, and a run resumed
anywhere, gets the same augmented image, while the same image gets new draws in every epoch
(where its stream index differs).
"""

from __future__ import annotations

import numpy as np

from jaxdist.config import AugmentConfig

# Mixed into the seed so these draws never repeat another consumer of (seed, index).
_STREAM = 0x417567  # "Aug"


class Augment:
    """`augment(index, example)`: `example` with its `images` [H, W, ...] randomly cropped and flipped.

    Crop: the image is padded by `crop_padding` zero pixels on each side and an H x W window is cut
    at an offset drawn uniformly from [0, 2 x crop_padding] along each axis. Flip: with probability
    1/2 the columns are reversed. Other keys pass through unchanged.
    """

    def __init__(self, seed: int, crop_padding: int = 0, flip: bool = False):
        self.seed, self.crop_padding, self.flip = seed, crop_padding, flip

    @classmethod
    def from_config(cls, augment: AugmentConfig, seed: int) -> Augment | None:
        """The augmentation `augment` (`data.augment`) asks for, or None when it asks for none."""
        return cls(seed, augment.crop_padding, augment.flip) if augment.active else None

    def draws(self, index: int) -> tuple[int, int, bool]:
        """(row offset, column offset, flip) of the example at global index `index`."""
        rng = np.random.default_rng((_STREAM, self.seed, index))
        top, left = (int(offset) for offset in rng.integers(0, 2 * self.crop_padding + 1, size=2))
        return top, left, bool(rng.random() < 0.5) and self.flip

    def __call__(self, index: int, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        image = example["images"]
        top, left, flip = self.draws(index)
        if self.crop_padding:
            pad = self.crop_padding
            padded = np.pad(image, [(pad, pad), (pad, pad)] + [(0, 0)] * (image.ndim - 2))
            image = padded[top : top + image.shape[0], left : left + image.shape[1]]
        if flip:
            image = image[:, ::-1]
        return {**example, "images": np.ascontiguousarray(image)}
