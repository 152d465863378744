"""`jaxdist data prepare FOLDER`: a folder of class folders of images -> labeled ArrayRecord shards.

`FOLDER/CLASS/.../IMAGE.png`: each subfolder of FOLDER is a class, its label the position of its
name in sorted order; PNG and JPEG files below it are its images. Each image is decoded with
Pillow (EXIF rotation applied, 16-bit pixels scaled to 8 bits), converted to RGB (or grayscale),
its shorter side resized to `image_size` and its center cropped to a square, so all images share
one shape. A record is the label (int32, little-endian) followed by the uint8 pixels in H, W, C
order (`sources.ArrayRecordImages` reads it back).

The eval split is stratified: of each class's n files, round(n x `eval_fraction`) (at least one
when the fraction is above 0, never all) are held out, those whose path inside the class folder
has the smallest CRC-32, so the split is the same on every run and after moving the folder.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxdist import atomic
from jaxdist.data import shards, sources
from jaxdist.errors import UserError, optional_import

SUFFIXES = (".png", ".jpg", ".jpeg")
SPLITS = ("train", "eval")
# Images decoded ahead of the writer: bounds memory while the thread pool keeps busy.
DECODE_AHEAD = 256


def _visible_files(path: Path) -> Iterator[Path]:
    """`path` itself if a file, else every file below it, sorted, skipping hidden files and folders."""
    if path.is_file():
        yield path
    elif path.is_dir():
        yield from sorted(
            p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )


def is_image(path: Path) -> bool:
    """Whether `path` is named as a PNG or JPEG image."""
    return path.suffix.lower() in SUFFIXES


def image_folder(inputs: list[str]) -> Path | None:
    """The folder of class folders when most files of `inputs` are images; None when they are text.

    The majority decides because a text corpus may hold a few images (a logo among its docs, which
    the text path skips with a warning) and an image folder a stray file (which the checks here and
    in `class_files` name). Images in any other form (beside text inputs,
    loose in the folder, next to the class folders) are a `UserError` that says where they go.
    """
    files = [path for name in inputs for path in _visible_files(Path(name))]
    found = [path for path in files if is_image(path)]
    if len(found) <= len(files) - len(found):
        return None
    folder = Path(inputs[0])
    if len(inputs) != 1 or not folder.is_dir():
        raise UserError(
            f"data prepare: {found[0]} is an image among other inputs; prepare an image folder on its own: one "
            f"folder with a subfolder of images per class"
        )
    entries = sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))
    if not any(entry.is_dir() for entry in entries):
        raise UserError(f"data prepare: {folder} holds images but no class folders; move each class's images "
                        f"into a subfolder named after the class")
    if loose := [entry for entry in entries if not entry.is_dir()]:
        raise UserError(f"data prepare: {loose[0]} lies beside the class folders of {folder}; an image folder "
                        f"holds only one subfolder of images per class")
    return folder


def class_files(folder: Path) -> dict[str, list[str]]:
    """Each class (subfolder name, sorted) -> its image files' paths inside its folder, sorted."""
    classes = {}
    for directory in sorted(entry for entry in folder.iterdir() if entry.is_dir() and not entry.name.startswith(".")):
        files = list(_visible_files(directory))
        if other := [path for path in files if not is_image(path)]:
            raise UserError(f"data prepare: {other[0]} is not a PNG or JPEG file; an image folder's class folders "
                            f"hold only images: remove it")
        if not files:
            raise UserError(f"data prepare: class folder {directory} holds no images; add PNG or JPEG files or "
                            f"remove the folder")
        classes[directory.name] = [path.relative_to(directory).as_posix() for path in files]
    return classes


def held_out(folder: Path, name: str, files: list[str], eval_fraction: float) -> set[str]:
    """The files of class `name` that go to the eval split (see the module docstring)."""
    if not eval_fraction:
        return set()
    count = max(1, round(len(files) * eval_fraction))
    if count >= len(files):
        raise UserError(
            f"data prepare: class folder {folder / name} holds {len(files)} image(s), too few to keep some for "
            f"both train and eval at --eval-fraction={eval_fraction}; add images or use --eval-fraction=0"
        )
    return set(sorted(files, key=lambda file: (zlib.crc32(file.encode()), file))[:count])


def load_image(path: Path, size: int, grayscale: bool) -> np.ndarray:
    """The uint8 [size, size, C] pixels of the image file at `path` (C = 1 grayscale, else 3)."""
    Image = optional_import("PIL.Image", "images", "data prepare: an image folder")
    ImageOps = optional_import("PIL.ImageOps", "images", "data prepare: an image folder")
    try:
        with Image.open(path) as image:
            upright = _eight_bit(ImageOps.exif_transpose(image), path).convert("L" if grayscale else "RGB")
            pixels = np.asarray(ImageOps.fit(upright, (size, size), Image.Resampling.BICUBIC), np.uint8)
    except Image.UnidentifiedImageError:
        raise UserError(f"data prepare: {path} is not a readable image (no format Pillow knows); replace or "
                        f"remove it") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError) as err:
        # What Pillow's decoders raise for damaged or truncated files.
        raise UserError(f"data prepare: {path} is not a readable image ({shards.first_line(err)}); replace or "
                        f"remove it") from None
    return pixels.reshape(size, size, -1)


def _eight_bit(image, path: Path):
    """`image` with 16-bit gray pixels (Pillow's modes I;16..., and I, which older Pillow gives 16-bit
    PNGs) scaled to 8 bits: `convert` would clip them at 255 instead, turning nearly all of them white."""
    from PIL import Image  # load_image imported it, or said which extra installs it

    if image.mode == "F":
        raise UserError(f"data prepare: {path} holds floating-point pixels, which have no fixed range; save it as "
                        f"an 8- or 16-bit PNG")
    if not image.mode.startswith("I"):
        return image
    pixels = np.asarray(image)
    if pixels.min() < 0 or pixels.max() > 65535:
        raise UserError(f"data prepare: {path} holds pixel values outside 0 to 65535 (16 bits); save it as an 8- or "
                        f"16-bit PNG")
    return Image.fromarray(np.rint(pixels / 257).astype(np.uint8))  # 65535 / 257 = 255


def _in_order(load: Callable[[Path], np.ndarray], paths: list[Path]) -> Iterator[np.ndarray]:
    """`load(path)` for each of `paths`, in order, decoded by a thread pool (Pillow releases the GIL)."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        for start in range(0, len(paths), DECODE_AHEAD):
            yield from pool.map(load, paths[start : start + DECODE_AHEAD])


def prepare(
    folder: Path,
    out: str,
    image_size: int = 32,
    grayscale: bool = False,
    eval_fraction: float = 0.1,
    records_per_shard: int = 4096,
) -> dict:
    """Writes the images of `folder` (see `image_folder`) as labeled ArrayRecord shards under `out`;
    returns the manifest."""
    if not 0 <= eval_fraction < 1:
        raise UserError(f"data prepare: --eval-fraction={eval_fraction} must be in [0, 1)")
    if image_size < 1 or records_per_shard < 1:
        raise UserError("data prepare: --image-size and --records-per-shard must be positive")
    files = class_files(folder)
    classes = {name: label for label, name in enumerate(files)}
    work = []  # (split, class, file), class by class
    for name, names in files.items():
        held = held_out(folder, name, names, eval_fraction)
        work += [("eval" if file in held else "train", name, folder / name / file) for file in names]
    load = functools.partial(load_image, size=image_size, grayscale=grayscale)
    channels = 1 if grayscale else 3
    with shards.new_directory(out) as scratch:
        writers = {split: shards.RecordWriter(scratch, split, records_per_shard) for split in SPLITS}
        per_class = {split: dict.fromkeys(classes, 0) for split in SPLITS}
        for (split, name, _), pixels in zip(work, _in_order(load, [path for _, _, path in work]), strict=True):
            writers[split].write(np.array(classes[name], sources.LABEL_DTYPE).tobytes() + pixels.tobytes())
            per_class[split][name] += 1
        manifest = {
            "format": sources.IMAGES_MANIFEST_FORMAT,
            "classes": classes,
            "image_shape": [image_size, image_size, channels],
            "record": "int32 label (little-endian), then uint8 pixels in H, W, C order",
            "eval_fraction": eval_fraction,
            "input": str(folder),
            "files_per_class": {name: len(names) for name, names in files.items()},
            "splits": {
                split: {**writers[split].close(), "examples": sum(per_class[split].values()), "per_class": per_class[split]}
                for split in SPLITS
            },
        }
        atomic.write_text(scratch / sources.MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def summary(out: str, manifest: dict) -> str:
    """One line on what `prepare` wrote."""
    splits = manifest["splits"]
    shape = " x ".join(str(size) for size in manifest["image_shape"])
    return (f"wrote {out}: {len(manifest['classes'])} classes, train {splits['train']['examples']} / eval "
            f"{splits['eval']['examples']} images of {shape}")
