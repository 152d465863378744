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
        # Three 32-bit words hashed from (seed, index) by numpy's SeedSequence; the modulo's bias is < 1e-8.
        row, column, coin = np.random.SeedSequence((_STREAM, self.seed, index)).generate_state(3)
        window = 2 * self.crop_padding + 1
        return int(row % window), int(column % window), self.flip and bool(coin & 1)

    def __call__(self, index: int, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        image = example["images"]
        top, left, flip = self.draws(index)
        if self.crop_padding:
            # The window at (top, left) of the padded image: out[y, x] = image[y + top - pad, x + left - pad], else 0.
            rows_out, rows_in = _overlap(top - self.crop_padding, image.shape[0])
            columns_out, columns_in = _overlap(left - self.crop_padding, image.shape[1])
            cropped = np.zeros_like(image)
            cropped[rows_out, columns_out] = image[rows_in, columns_in]
            image = cropped
        if flip:
            image = np.ascontiguousarray(image[:, ::-1])
        return {**example, "images": image}


def _overlap(shift: int, size: int) -> tuple[slice, slice]:
    """(out, in): the positions i with out[i] = in[i + shift] inside both arrays of length `size`."""
    start = max(0, -shift)
    stop = max(start, min(size, size - shift))
    return slice(start, stop), slice(start + shift, stop + shift)
