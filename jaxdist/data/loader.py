"""From the config to this process's batches: the train stream, the eval pass, the tokenizer.

`data.source` picks the examples: `stdlib` (the embedded corpus, byte tokens), `arrayrecord`
(token shards written by `jaxdist data prepare` under `data.path`), `images` (labeled-image shards
written by `jaxdist data prepare FOLDER`), `arrays` (a `.npz` of equally long arrays under
`data.path`, loaded into memory) or `digits` (scikit-learn's 8x8 digit images, data/digits.py).
`data.augment` changes train images, never eval ones. Everything a user can get wrong is checked
when a split is opened, before the loop compiles anything.
"""

from __future__ import annotations

import contextlib
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from jaxdist.config import ClassifierSection, Config, DataConfig
from jaxdist.config.base import HF_PREFIX
from jaxdist.data import corpus, digits, sources, stream
from jaxdist.data.augment import Augment
from jaxdist.data import tokenizer as tokenizer_lib
from jaxdist.errors import UserError, warn
from jaxdist.parallel import distributed
from jaxdist.parallel.feed import BatchRows

Batch = dict[str, np.ndarray]
# The arrays of a labeled-image example.
IMAGE_KEYS = ("images", "labels")


def open_split(cfg: Config, split: str, keys: tuple[str, ...] = ()):
    """The random-access source of `split` ('train' or 'eval') that `cfg.data` describes; an `arrays`
    file must hold the arrays named in `keys` (the model's batch keys), and only those are fed
    (without `keys`, all of its arrays)."""
    data = cfg.data
    if data.source in ("stdlib", "arrayrecord") and cfg.model.tokens_per_example is None:
        raise UserError(f"data.source={data.source} holds token sequences, but model.name={cfg.model.name} reads "
                        f"images and labels; use data.source=images, digits or arrays")
    _check_eval_fraction(data)
    if data.source == "stdlib":
        name = f"the {split} split of the stdlib corpus (data.eval_fraction={data.held_out})"
        tokens = corpus.stdlib_tokens(split, data.held_out)
        empty = "change data.eval_fraction or set eval.every=0" if split == "eval" else "lower data.eval_fraction"
        return _windows(tokens, cfg, name, tokenizer_lib.ByteTokenizer.vocab_size, "the stdlib corpus", empty,
                        corpus.SEPARATOR)
    if data.source == "arrayrecord" and data.mixture:
        parts = mixture_splits(cfg, split)
        weights = [source.weight for source in data.mixture]
        return grain.MapDataset.mix([grain.MapDataset.source(part) for part in parts.values()], weights)
    if data.source == "arrayrecord":
        directory = Path(data.path)
        return _prepared_split(cfg, directory, sources.read_manifest(directory), split, f"data.path={data.path}")
    if data.source == "images":
        return _images(cfg, split, keys)
    if data.source == "digits":
        arrays, name, fix = digits.split(split), "data.source=digits", "use a classifier (model.name=mlp or resnet)"
        held = tuple(arrays)
    else:
        path, name = Path(data.path), f"data.path={data.path}"
        held, fix = _array_names(path), f"save them with numpy.savez(path, {'=..., '.join(keys)}=...)"
    if missing := [key for key in keys if key not in held]:
        raise UserError(f"{name} lacks the array(s) {', '.join(missing)} that model.name={cfg.model.name} reads "
                        f"(it holds {', '.join(held)}); {fix}")
    if data.source == "arrays":
        # Only the model's arrays: another would reach the step and crash it (strings) or change it
        # (`weights` would weight the loss). Said once, for the train split.
        if keys and split == "train" and (ignored := [key for key in held if key not in keys]):
            warn(f"{name}: the array(s) {', '.join(ignored)} are not fed to the model (model.name={cfg.model.name} "
                 f"reads {', '.join(keys)})")
        arrays = _array_split(path, split, data.held_out, keys or None)
    _check_shapes(arrays, cfg, name)
    _check_ids(arrays, cfg, name)
    return sources.ArraySource(_eight_bit_pixels(arrays, name), name)


def _check_eval_fraction(data: DataConfig) -> None:
    """data.eval_fraction splits what is read whole (the stdlib corpus, an arrays file); given for a
    source whose split was fixed when it was made, it would change nothing."""
    if data.eval_fraction is None or data.source in ("stdlib", "arrays"):
        return
    if data.source == "digits":
        raise UserError(f"data.eval_fraction={data.eval_fraction} does not apply to data.source=digits, whose split "
                        f"is fixed ({digits.EVAL_EXAMPLES} images held out for eval); drop data.eval_fraction")
    raise UserError(f"data.eval_fraction={data.eval_fraction} does not apply to data.source={data.source}: its eval "
                    f"split was made by `jaxdist data prepare` (--eval-fraction); drop data.eval_fraction, or prepare "
                    f"the data again with --eval-fraction {data.eval_fraction}")


def _check_shapes(arrays: dict[str, np.ndarray], cfg: Config, name: str) -> None:
    """Each example must have the shape the model is built for. Token rows of another length than
    model.seq_len fail inside the step, or train at a length the model's positions and the reported
    tokens/s do not assume; labels [N, 1] fail inside the loss; other images fail in the first layer."""
    model = cfg.model
    if model.tokens_per_example is not None:
        seq_len = model.tokens_per_example
        for key in ("inputs", "targets"):
            rows = arrays.get(key)
            if rows is None or rows.shape[1:] == (seq_len,):
                continue
            if rows.ndim == 2:
                raise UserError(f"{name}: {key} holds rows of {rows.shape[1]} tokens, not model.seq_len={seq_len}; "
                                f"set model.seq_len={rows.shape[1]}")
            raise UserError(f"{name}: {key} has shape {_shape(rows)}; a language model reads rows of token ids, "
                            f"[N, model.seq_len={seq_len}]")
        return
    labels, images = arrays.get("labels"), arrays.get("images")
    if labels is not None and labels.ndim != 1:
        fix = ": save labels.reshape(-1)" if labels.shape[1:] == (1,) else ""
        raise UserError(f"{name}: labels has shape {_shape(labels)}; a classifier reads one class id per "
                        f"example, [N]{fix}")
    expected = model.image_shape
    if images is None or expected == "auto" or images.shape[1:] == tuple(expected):
        return
    if images.ndim != 4:
        fix = "save them as [N, height, width, channels]"
    elif (*images.shape[2:], images.shape[1]) == tuple(expected):
        fix = "they look channels-first (N, C, H, W): save images.transpose(0, 2, 3, 1)"
    else:
        fix = f"set model.image_shape={list(images.shape[1:])} or auto"
    raise UserError(f"{name}: images has shape {_shape(images)}, not [N, *model.image_shape] = "
                    f"[N, {', '.join(map(str, expected))}]; {fix}")


def _shape(array: np.ndarray) -> str:
    """An array's shape with its rows as N (a split holds some of the file's rows)."""
    return f"[{', '.join(['N', *map(str, array.shape[1:])])}]"


def _eight_bit_pixels(arrays: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """`arrays` with integer images as uint8: they are 8-bit pixels (as CIFAR and MNIST ship), fed
    as the `images` source's records are and scaled to [0, 1] by the classifier, on the device."""
    images = arrays.get("images")
    if images is None or not np.issubdtype(images.dtype, np.integer) or images.dtype == np.uint8:
        return arrays
    if images.size:
        low, high = int(images.min()), int(images.max())
        if low < 0 or high > 255:
            raise UserError(f"{name}: images holds integers from {low} to {high}; integer images are read as "
                            f"8-bit pixels (0 to 255, divided by 255): save them as uint8, or as float32 in [0, 1]")
    return {**arrays, "images": images.astype(np.uint8)}


def _check_ids(arrays: dict[str, np.ndarray], cfg: Config, name: str) -> None:
    """Token ids and labels must index the model's vocabulary or classes: one out of range would
    gather a row that is not there, and train on garbage or NaN."""
    limits = {"inputs": "vocab", "targets": "vocab", "labels": "classes"}
    for key, size_key in limits.items():
        size, ids = getattr(cfg.model, size_key, None), arrays.get(key)
        if not isinstance(size, int) or ids is None or not ids.size:
            continue
        if not np.issubdtype(ids.dtype, np.integer):
            raise UserError(f"{name}: {key} must hold integers (ids of model.{size_key}), not {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            raise UserError(f"{name}: {key} holds the id {low}; ids count from 0 (model.{size_key}={size}): "
                            f"fix the data")
        if high >= size:
            fix = _fit_vocab(cfg, high + 1) if size_key == "vocab" else f"set model.{size_key}={high + 1} or auto"
            raise UserError(f"{name}: {key} holds the id {high}, beyond model.{size_key}={size} (ids 0 to "
                            f"{size - 1}); {fix}, or fix the data")


def _fit_vocab(cfg: Config, ids: int) -> str:
    """How to make the model's vocabulary hold data of `ids` token ids: model.vocab, unless a model
    folder decides it (model.init_from), whose tokenizer must then tokenize the data."""
    init_from = getattr(cfg.model, "init_from", None)
    if init_from is None:
        return f"set model.vocab={ids} or auto"
    tokenizer = Path(init_from.removeprefix(HF_PREFIX)) / tokenizer_lib.HUGGINGFACE_FILE
    where = "point data.path at DIR" if cfg.data.source == "arrayrecord" else "set data.source=arrayrecord data.path=DIR"
    return (f"model.init_from={init_from} decides model.vocab, so the data must be tokenized with that model's "
            f"tokenizer: prepare it with `jaxdist data prepare INPUTS --out DIR --tokenizer {tokenizer}` and {where}")


def mixture_splits(cfg: Config, split: str) -> dict[str, Any]:
    """Each `data.mixture` source's `split`, by name (the same tokenizer throughout, or a `UserError`)."""
    parts, tokenizers = {}, {}
    for source in cfg.data.mixture:
        manifest = sources.read_manifest(Path(source.path))
        where = f"data.mixture {source.name} (path {source.path})"
        parts[source.name] = _prepared_split(cfg, Path(source.path), manifest, split, where)
        tokenizers[source.name] = manifest["tokenizer"]
    first, *others = tokenizers.items()
    for name, entry in others:
        if (entry["name"], entry["vocab_size"], entry.get("separator")) != (
                first[1]["name"], first[1]["vocab_size"], first[1].get("separator")):
            raise UserError(f"data.mixture: {name} was prepared with tokenizer {entry['name']} (vocab "
                            f"{entry['vocab_size']}), {first[0]} with {first[1]['name']} (vocab {first[1]['vocab_size']}); "
                            f"prepare every source with one tokenizer")
    return parts


def _prepared_split(cfg: Config, directory: Path, manifest: dict, split: str, where: str):
    tokens = sources.ArrayRecordTokens(directory, manifest, split)
    empty = ("prepare the data again with `jaxdist data prepare --eval-fraction` above 0, or set eval.every=0"
             if split == "eval" else "prepare the data again with more documents")
    return _windows(tokens, cfg, f"the {split} split of {where}", manifest["tokenizer"]["vocab_size"], where, empty,
                    manifest["tokenizer"].get("separator"))


def token_folder(cfg: Config) -> Path:
    """The prepared folder whose manifest says the tokenizer: data.path, or a mixture's first source."""
    return Path(cfg.data.mixture[0].path if cfg.data.mixture else cfg.data.path)


def _windows(tokens, cfg: Config, name: str, vocab: int, vocab_of: str, empty: str, separator: int | None):
    """`tokens` as windows of model.seq_len, or with data.packing as rows of whole documents (split at
    `separator`); `empty` says what to do where there are none."""
    if cfg.model.vocab < vocab:
        raise UserError(f"model.vocab={cfg.model.vocab} is smaller than the vocabulary of {vocab_of} ({vocab} ids); "
                        f"{_fit_vocab(cfg, vocab)}")
    if not len(tokens):
        raise UserError(f"{name} is empty; {empty}")
    if cfg.data.packing:
        if separator is None:
            raise UserError(f"data.packing: {vocab_of} records no document separator; prepare the data again")
        return stream.PackedDocuments(tokens, cfg.model.seq_len, separator, name)
    return stream.TokenWindows(tokens, cfg.model.seq_len, name)


def _images(cfg: Config, split: str, keys: tuple[str, ...]) -> sources.ArrayRecordImages:
    directory = Path(cfg.data.path)
    manifest = sources.read_manifest(directory, sources.IMAGES_MANIFEST_FORMAT)
    images = sources.ArrayRecordImages(directory, manifest, split)
    if missing := [key for key in keys if key not in IMAGE_KEYS]:
        raise UserError(
            f"data.source=images yields {' and '.join(IMAGE_KEYS)}, but model.name={cfg.model.name} reads "
            f"{', '.join(missing)}; use a classifier model or another data.source"
        )
    if not len(images):
        raise UserError(
            f"the {split} split of data.path={directory} is empty; prepare it with `data prepare --eval-fraction` "
            f"above 0 or set eval.every=0"
        )
    _check_image_model(cfg, manifest, directory)
    return images


def _check_image_model(cfg: Config, manifest: dict, directory: Path) -> None:
    """A classifier's classes and image shape must fit the prepared images: a label beyond the
    classes makes the loss NaN (read as a numerical problem), another shape fails in the first layer."""
    model = cfg.model
    if not isinstance(model, ClassifierSection):
        return
    names = sorted(manifest["classes"], key=manifest["classes"].get)
    if model.classes != "auto" and model.classes < len(names):
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise UserError(f"data.path={directory} holds {len(names)} classes ({shown}), more than "
                        f"model.classes={model.classes}; set model.classes={len(names)} or auto")
    shape = list(manifest["image_shape"])
    if model.image_shape != "auto" and list(model.image_shape) != shape:
        raise UserError(f"data.path={directory} holds images of shape {shape}, not model.image_shape="
                        f"{list(model.image_shape)}; set model.image_shape={shape} or auto, or prepare the folder again")


@contextlib.contextmanager
def _npz(path: Path) -> Iterator[np.lib.npyio.NpzFile]:
    """The .npz at `path`, open; a missing or unreadable file (or array in it) is one line."""
    if path.is_dir() and (source := sources.prepared_source(path)):
        raise UserError(f"data.path={path} is a directory written by `jaxdist data prepare`, which "
                        f"data.source={source} reads; set data.source={source}")
    if path.is_dir():
        raise UserError(f"data.path={path} is a directory; pass a .npz file of equally long arrays")
    if not path.is_file():
        raise UserError(f"data.path={path} does not exist; pass a .npz file of equally long arrays")
    if not zipfile.is_zipfile(path):  # else numpy tries to unpickle it, and says so
        raise UserError(f"data.path={path} is not an .npz file; data.source=arrays reads arrays saved by "
                        f"numpy.savez (for text, run `jaxdist data prepare` and set data.source=arrayrecord)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            yield npz
    except (OSError, ValueError) as err:
        raise UserError(f"data.path={path} is not a readable .npz file ({type(err).__name__}: {err}); "
                        f"save it with numpy.savez") from None


def _array_names(path: Path) -> tuple[str, ...]:
    """The names of the arrays in the .npz at `path` (none of them read)."""
    with _npz(path) as npz:
        return tuple(npz.files)


def _load_arrays(path: Path, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The arrays of the .npz at `path` (only those of `names` it holds, when given)."""
    with _npz(path) as npz:
        return {name: npz[name] for name in npz.files if names is None or name in names}


# 2^64 / the golden ratio (Fibonacci hashing): frac(i / golden ratio), as 64 bits, of row i.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _array_split(path: Path, split: str, eval_fraction: float, names: tuple[str, ...] | None = None
                 ) -> dict[str, np.ndarray]:
    """The rows of `split` of the arrays `names` (default: all). Row i is held out for eval where
    frac(i / golden ratio) < `eval_fraction`: a function of i alone, so rows appended to the file
    never move a row between the splits, and a low-discrepancy sequence, so any run of rows holds
    out `eval_fraction` of them to within a few rows."""
    arrays = _load_arrays(path, names)
    rows = len(sources.ArraySource(arrays, f"data.path={path}"))
    held_out = np.arange(rows, dtype=np.uint64) * _GOLDEN < np.uint64(int(eval_fraction * 2**64))  # wraps mod 2^64
    chosen = np.flatnonzero(held_out if split == "eval" else ~held_out)
    if not len(chosen):
        raise UserError(
            f"the {split} split of data.path={path} ({rows} rows, data.eval_fraction={eval_fraction}) "
            f"is empty; change data.eval_fraction or set eval.every=0"
        )
    return {name: array[chosen] for name, array in arrays.items()}


def fingerprint(source, samples: int = 8) -> tuple[int, int]:
    """(examples, a CRC-32 of `samples` of them spread evenly from the first to the last) of a
    source: what tells two copies of a split apart (another length, other contents) for the price
    of a few reads, whatever its size (`feed.check_sources_agree`)."""
    count, checksum = len(source), 0
    for index in np.unique(np.linspace(0, count - 1, samples).round().astype(int)):
        example = source[int(index)]
        for key in sorted(example):
            checksum = zlib.crc32(np.ascontiguousarray(example[key]).tobytes(), checksum)
    return count, checksum


def tokenizer(cfg: Config) -> tokenizer_lib.Tokenizer:
    """The tokenizer of the configured data (bytes unless the prepared shards say otherwise)."""
    if cfg.data.source == "arrayrecord":
        directory = token_folder(cfg)
        return tokenizer_lib.load(sources.read_manifest(directory)["tokenizer"], directory)
    return tokenizer_lib.ByteTokenizer()


def data_vocab(cfg: Config) -> int:
    """The vocabulary size of the configured data: the prepared tokenizer's, 256 bytes for the
    stdlib corpus, or the largest token id + 1 of an `arrays` file's integer inputs and targets
    (which must hold no negative id: that is no vocabulary size)."""
    data = cfg.data
    if data.source in ("images", "digits"):
        raise UserError(f"model.vocab=auto: data.source={data.source} holds images, not tokens; use a token source")
    if data.source == "stdlib":
        return tokenizer_lib.ByteTokenizer.vocab_size
    if data.source == "arrayrecord":
        return int(sources.read_manifest(token_folder(cfg))["tokenizer"]["vocab_size"])
    tokens = {key: a for key, a in _load_arrays(Path(data.path), ("inputs", "targets")).items()
              if np.issubdtype(a.dtype, np.integer) and a.size}
    if not tokens:
        raise UserError(
            f"model.vocab=auto: data.path={data.path} has no integer inputs or targets arrays to take the "
            f"vocabulary from; set model.vocab to a number"
        )
    for key, ids in tokens.items():
        if (low := int(ids.min())) < 0:
            raise UserError(f"model.vocab=auto: data.path={data.path}: {key} holds negative token ids (the smallest "
                            f"is {low}); ids count from 0, and there is no ignore id such as -100: save the "
                            f"arrays with ids 0 to vocab - 1")
    return int(max(a.max() for a in tokens.values())) + 1


@dataclass(frozen=True)
class ImageData:
    """What a classifier takes from its labeled-image data: the classes and one image's shape."""

    classes: int
    image_shape: tuple[int, int, int]  # H, W, C
    class_names: tuple[str, ...]  # label id -> name


def data_images(cfg: Config) -> ImageData:
    """The classes and image shape of the configured labeled images: from the manifest of
    `data.source=images`, the digits' 10 and 8x8x1, or an `arrays` file's `images` [N, H, W, C] and
    `labels` (classes: the largest label + 1, named by their ids)."""
    data = cfg.data
    if data.source == "digits":
        return ImageData(digits.CLASSES, digits.IMAGE_SHAPE, tuple(str(i) for i in range(digits.CLASSES)))
    if data.source == "images":
        manifest = sources.read_manifest(Path(data.path), sources.IMAGES_MANIFEST_FORMAT)
        names = tuple(sorted(manifest["classes"], key=manifest["classes"].get))
        return ImageData(len(names), tuple(manifest["image_shape"]), names)
    if data.source != "arrays":
        raise UserError(
            f"data.source={data.source} holds no labeled images to take the classes and image shape from; "
            f"use data.source=images, digits or arrays, or set model.classes and model.image_shape"
        )
    image_shape, labels = _image_shape_and_labels(Path(data.path))
    if image_shape is None or labels is None or len(image_shape) != 3 or not np.issubdtype(labels.dtype, np.integer) \
            or not labels.size:
        raise UserError(
            f"data.path={data.path} needs an images array [N, H, W, C] and an integer labels array [N] to take "
            f"the classes and image shape from; save them with numpy.savez(path, images=..., labels=...)"
        )
    height, width, channels = image_shape
    if channels not in (1, 3, 4) and height in (1, 3):
        warn(f"data.path={data.path}: images [N, {height}, {width}, {channels}] are read as [N, height, width, "
             f"channels], {channels} channels; if they are channels-first (N, C, H, W), save "
             f"images.transpose(0, 2, 3, 1)")
    classes = int(labels.max()) + 1
    return ImageData(classes, image_shape, tuple(str(i) for i in range(classes)))


def _image_shape_and_labels(path: Path) -> tuple[tuple[int, ...] | None, np.ndarray | None]:
    """One image's shape (from the `images` array's header: its data stays unread) and the `labels`
    of the .npz at `path`; None for an array it lacks."""
    labels = _load_arrays(path, ("labels",)).get("labels")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "images" not in npz.files:
                return None, labels
            with npz.zip.open("images.npy") as member:
                version = np.lib.format.read_magic(member)
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                shape = read_header(member)[0] if read_header else npz["images"].shape
    except (OSError, ValueError) as err:
        raise UserError(f"data.path={path} is not a readable .npz file ({err}); save it with numpy.savez") from None
    return tuple(int(size) for size in shape[1:]) if len(shape) == 4 else (), labels


def resolve_model(cfg: Config) -> Config:
    """`cfg` with every `auto` of its model section taken from its data: model.vocab (`data_vocab`),
    model.classes and model.image_shape (`data_images`)."""
    model, update = cfg.model, {}
    if getattr(model, "vocab", None) == "auto":
        update["vocab"] = data_vocab(cfg)
    if isinstance(model, ClassifierSection) and "auto" in (model.classes, model.image_shape):
        found = data_images(cfg)
        if model.classes == "auto":
            update["classes"] = found.classes
        if model.image_shape == "auto":
            update["image_shape"] = list(found.image_shape)
    if not update:
        return cfg
    return cfg.model_copy(update={"model": model.model_copy(update=update)})


def resolve_workers(cfg: Config) -> Config:
    """`cfg` with `data.workers: auto` set to a count (`stream.auto_workers`) from its data source,
    this process's usable cores and the processes that share them. Any count gives the same
    batches, so a resumed run may resolve another one on another host. Collective where several
    processes run: every process must call it (`jaxdist train` does, where it takes the model's
    sizes from the data)."""
    if cfg.data.workers != "auto":
        return cfg
    workers = stream.auto_workers(cfg.data.source, stream.usable_cores(), distributed.processes_sharing_cores())
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"workers": workers})})


def describe(cfg: Config) -> str:
    """One line on how the train batches are read: source, worker processes, threads, read-ahead."""
    data = cfg.data
    where = "" if data.path is None else f" from {data.path}"
    if data.mixture:
        where = " mixed from " + ", ".join(f"{source.name} ({source.path}, weight {source.weight:g})"
                                           for source in data.mixture)
    readers = ("the training process" if data.workers == 0 else
               f"data.workers={data.workers} worker processes" if data.workers == "auto" else
               f"{data.workers} worker process{'es' if data.workers > 1 else ''}")
    return (f"data: {data.source}{where}, read in {readers} ({data.read_threads} read threads, "
            f"{data.prefetch} batches ahead)")


def resolve_steps(cfg: Config, train_examples: int, start_step: int = 0, start_example: int = 0,
                  log: Callable[[str], None] | None = None) -> Config:
    """`cfg` with `train.steps` set (when `data.epochs` is) to end the run after `data.epochs` passes
    over `train_examples`, or at `train.steps` where that is set too and comes first (`log` says
    which). A resumed run (`start_step` steps done, `start_example` examples read) counts the
    examples left, so the end stays where it was under another `train.global_batch`."""
    if cfg.data.epochs is None:
        return cfg
    total = cfg.data.epochs * train_examples
    if total < cfg.train.global_batch:
        raise UserError(
            f"data.epochs={cfg.data.epochs} over {train_examples} train examples is less than one "
            f"train.global_batch={cfg.train.global_batch}; use more epochs or a smaller batch"
        )
    steps = start_step + max(0, total - start_example) // cfg.train.global_batch
    if "steps" in cfg.train.model_fields_set and cfg.train.steps != steps and log is not None:
        first, later = (("train.steps", "data.epochs") if cfg.train.steps < steps else ("data.epochs", "train.steps"))
        log(f"data.epochs={cfg.data.epochs} ends the run at step {steps:,} and train.steps={cfg.train.steps:,} at "
            f"step {cfg.train.steps:,}: the run ends at the earlier, where {first} says ({later} is not reached)")
    if "steps" in cfg.train.model_fields_set:
        steps = min(steps, cfg.train.steps)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})})


def train_iterator(cfg: Config, rows: BatchRows, start_example: int = 0, source=None) -> Iterator[Batch]:
    """This process's train batches (the `rows` it feeds of each global batch) from global example
    `start_example` on (0: the beginning), augmented as `data.augment` says.

    After global step s the position is `s * train.global_batch`, under any process count and any
    `data.workers`. A single process resolves `data.workers: auto` here if the config has not;
    several processes must have resolved it (`resolve_workers`, a collective).
    """
    source = open_split(cfg, "train") if source is None else source
    if cfg.data.workers == "auto" and jax.process_count() > 1:  # resolving it is a collective: never hidden here
        raise UserError("data.workers=auto is not resolved; pass the config through "
                        "jaxdist.data.loader.resolve_workers on every process first (jaxdist train does)")
    cfg = resolve_workers(cfg)
    augment = Augment.from_config(cfg.data.augment, cfg.seed)
    if augment is not None and "images" not in source[0]:
        raise UserError(
            f"data.augment changes images, but data.source={cfg.data.source} yields {', '.join(source[0])}; "
            f"set data.augment.crop_padding=0 and data.augment.flip=false"
        )
    return stream.train_batches(
        source, rows, cfg.seed, start_example=start_example,
        read_threads=cfg.data.read_threads, prefetch=cfg.data.prefetch, workers=cfg.data.workers, augment=augment,
    )


def eval_iterator(cfg: Config, rows: BatchRows, source=None) -> Iterator[Batch]:
    """This process's batches (its `rows` of each) of one pass over the eval split, with `weights`
    (0 on padding rows)."""
    source = open_split(cfg, "eval") if source is None else source
    return stream.eval_batches(
        source, rows, max_batches=cfg.eval.batches, read_threads=cfg.data.read_threads, prefetch=cfg.data.prefetch,
    )
