"""Train-image augmentation: a random crop of the zero-padded image and a random left-right flip.

The randomness of an example is drawn from (seed, its global example index), the same number
that is the data position (`pipeline`): every process that reads the example, and a run resumed
anywhere, gets the same augmented image, while the same image gets new draws in every epoch
(where its stream index differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only named: this module runs without pydantic (benchmarks/bench_data.py)
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
        if not (self.crop_padding or flip):
            return example
        # One copy: the window's pixels go straight to where the crop and the flip put them; the
        # rest stays zero. out[y, x] = image[y + top - pad, x + left - pad] (then x mirrored).
        height, width = image.shape[:2]
        rows_out, rows_in = _overlap(top - self.crop_padding, height)
        columns_out, columns_in = _overlap(left - self.crop_padding, width)
        window = _pixels(image)[rows_in, columns_in]
        if flip:
            window = window[:, ::-1]
            columns_out = slice(width - columns_out.stop, width - columns_out.start)
        out = np.zeros(image.shape, image.dtype)
        _pixels(out)[rows_out, columns_out] = window
        return {**example, "images": out}


def _pixels(image: np.ndarray) -> np.ndarray:
    """`image` [H, W, ...] as [H, W] of whole pixels (one item each: all channels' bytes), so that a
    mirrored copy moves pixels, not single channel values (several times faster for RGB); a view
    where `image` is C-contiguous."""
    image = np.ascontiguousarray(image)
    size = image[0, 0].nbytes
    item = np.dtype(f"u{size}") if size in (1, 2, 4, 8) else np.dtype(f"V{size}")
    return image.reshape(*image.shape[:2], -1).view(item).reshape(image.shape[:2])


def _overlap(shift: int, size: int) -> tuple[slice, slice]:
    """(out, in): the positions i with out[i] = in[i + shift] inside both arrays of length `size`."""
    start = max(0, -shift)
    stop = max(start, min(size, size - shift))
    return slice(start, stop), slice(start + shift, stop + shift)
