"""`data.augment`: random crops of the padded image and flips, drawn from (seed, global example index):
the same after a resume and on every process, new each epoch, never on eval batches."""

from itertools import islice

import numpy as np
import pytest
from conftest import make_config

from jaxdist.data import loader
from jaxdist.data.augment import Augment
from jaxdist.parallel.feed import BatchRows

IMAGE = (np.arange(8 * 8 * 3, dtype=np.float32).reshape(8, 8, 3) + 1) / 200  # distinct, non-zero pixels
ROWS = 90  # of which data.eval_fraction=0.1 holds out 10 for eval
BATCH = 8


def window_offset(out: np.ndarray, image: np.ndarray, pad: int) -> tuple[int, int]:
    """The one (top, left) at which `out` is a window of `image` padded by `pad` zeros."""
    padded = np.pad(image, [(pad, pad), (pad, pad), (0, 0)])
    height, width = image.shape[:2]
    found = [(top, left) for top in range(2 * pad + 1) for left in range(2 * pad + 1)
             if np.array_equal(out, padded[top : top + height, left : left + width])]
    assert len(found) == 1, found
    return found[0]


def test_a_crop_is_a_shifted_window_of_the_padded_image():
    augment = Augment(seed=0, crop_padding=2)
    offsets = []
    for index in range(400):
        out = augment(index, {"images": IMAGE, "labels": np.int32(3)})
        assert out["labels"] == 3 and out["images"].shape == (8, 8, 3) and out["images"].dtype == np.float32
        offsets.append(window_offset(out["images"], IMAGE, 2))
        assert offsets[-1] == augment.draws(index)[:2]
    counts = np.bincount([5 * top + left for top, left in offsets], minlength=25)
    assert counts.min() >= 5 and counts.max() <= 35  # all 25 windows, each about 16 times in 400


def test_a_flip_mirrors_about_half_the_images():
    augment = Augment(seed=0, flip=True)
    outs = [augment(index, {"images": IMAGE})["images"] for index in range(400)]
    mirrored = [np.array_equal(out, IMAGE[:, ::-1]) for out in outs]
    assert all(m or np.array_equal(out, IMAGE) for m, out in zip(mirrored, outs))
    assert 160 <= sum(mirrored) <= 240
    assert mirrored == [augment.draws(index)[2] for index in range(400)]


def test_the_draws_are_fixed_by_seed_and_index():
    first, again, other = Augment(0, 4, True), Augment(0, 4, True), Augment(1, 4, True)
    for index in (0, 1, 12345, 10**12):
        np.testing.assert_array_equal(first(index, {"images": IMAGE})["images"], again(index, {"images": IMAGE})["images"])
    assert sum(first.draws(index) == other.draws(index) for index in range(200)) < 10  # 1 in 162 by chance


@pytest.fixture
def arrays_config(tmp_path):
    """A config of an .npz of 90 distinct random images whose labels are their row numbers."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", images=rng.random((ROWS, 8, 8, 3), np.float32), labels=np.arange(ROWS, dtype=np.int32))

    def config(global_batch=BATCH, workers=0, **augment):
        return make_config(tmp_path, data={"source": "arrays", "path": str(tmp_path / "images.npz"), "eval_fraction": 0.1,
                                           "augment": augment, "workers": workers}, train={"global_batch": global_batch})
    return config


def test_off_the_train_images_are_the_stored_ones(arrays_config):
    cfg = arrays_config()
    source = loader.open_split(cfg, "train")
    for batch in islice(loader.train_iterator(cfg, BatchRows(BATCH, tuple(range(BATCH)))), 12):
        stored = np.stack([source.arrays["images"][source.arrays["labels"] == label][0] for label in batch["labels"]])
        np.testing.assert_array_equal(batch["images"], stored)


def test_epochs_reshuffle_and_augment_the_same_image_anew(arrays_config):
    n = ROWS - 10
    cfg = arrays_config(global_batch=n, crop_padding=2, flip=True)  # one global batch = one epoch
    source = loader.open_split(cfg, "train")
    assert len(source) == n
    epochs = list(islice(loader.train_iterator(cfg, BatchRows(n, tuple(range(n))), source=source), 3))
    orders = [list(batch["labels"]) for batch in epochs]
    assert all(sorted(order) == sorted(source.arrays["labels"]) for order in orders)  # each epoch: every image once
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert sum(a == b for a, b in zip(orders[0], orders[1])) < n // 5
    stored = dict(zip(source.arrays["labels"], source.arrays["images"]))
    by_label = [dict(zip(batch["labels"], batch["images"])) for batch in epochs]
    same = sum(np.array_equal(by_label[0][label], by_label[1][label]) for label in stored)
    assert same < 10  # the same draws for an image in two epochs: 1 in 50 by chance
    for epoch, batch in enumerate(epochs):  # every image is the window and flip its stream index draws
        for row, label in enumerate(batch["labels"]):
            top, left, flip = Augment(cfg.seed, 2, True).draws(epoch * n + row)
            padded = np.pad(stored[label], [(2, 2), (2, 2), (0, 0)])
            window = padded[top : top + 8, left : left + 8]
            np.testing.assert_array_equal(batch["images"][row], window[:, ::-1] if flip else window)


def test_a_resumed_iterator_and_every_process_see_the_same_augmented_batches(arrays_config):
    cfg = arrays_config(crop_padding=1, flip=True)
    whole = BatchRows(BATCH, tuple(range(BATCH)))
    running = list(islice(loader.train_iterator(cfg, whole), 25))  # 200 examples: into the third epoch
    # Resumed where another host's data.workers: auto resolves to worker processes: the same batches.
    elsewhere = arrays_config(crop_padding=1, flip=True, workers=2)
    resumed = list(islice(loader.train_iterator(elsewhere, whole, start_example=13 * BATCH), 12))
    halves = [list(islice(loader.train_iterator(cfg, BatchRows(BATCH, rows), start_example=13 * BATCH), 12))
              for rows in ((0, 1, 2, 3), (4, 5, 6, 7))]
    for step, batch in enumerate(running[13:]):
        for key in ("images", "labels"):
            np.testing.assert_array_equal(resumed[step][key], batch[key])
            np.testing.assert_array_equal(np.concatenate([half[step][key] for half in halves]), batch[key])


def test_eval_batches_are_never_augmented(arrays_config):
    cfg = arrays_config(crop_padding=3, flip=True)
    source = loader.open_split(cfg, "eval")
    batches = list(loader.eval_iterator(cfg, BatchRows(BATCH, tuple(range(BATCH)))))
    assert len(source) == 10 and len(batches) == 2
    images = np.concatenate([batch["images"] for batch in batches])
    weights = np.concatenate([batch["weights"] for batch in batches])
    np.testing.assert_array_equal(images[:10], source.arrays["images"])
    np.testing.assert_array_equal(weights, [1] * 10 + [0] * 6)


# Float RGB, 8-bit RGB (a prepared folder's pixels), 8-bit gray, and 4 float channels.
IMAGES = [IMAGE, (IMAGE * 200).astype(np.uint8), (IMAGE[..., :1] * 200).astype(np.uint8),
          np.concatenate([IMAGE, IMAGE[..., :1]], axis=-1)]


@pytest.mark.parametrize("image", IMAGES, ids=["float32_rgb", "uint8_rgb", "uint8_gray", "float32_4"])
@pytest.mark.parametrize("pad", [0, 3, 8, 11])  # up to a padding wider than the 8 x 8 image
def test_the_crop_equals_numpys_padding_at_the_drawn_offset(pad, image):
    augment = Augment(seed=5, crop_padding=pad, flip=True)
    padded = np.pad(image, [(pad, pad), (pad, pad), (0, 0)])
    for index in range(100):
        top, left, flip = augment.draws(index)
        window = padded[top : top + 8, left : left + 8]
        out = augment(index, {"images": image})["images"]
        assert out.dtype == image.dtype and out.flags.c_contiguous
        np.testing.assert_array_equal(out, window[:, ::-1] if flip else window)
