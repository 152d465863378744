"""Input pipeline throughput against what a GPU consumes: every source, per count of data workers.

    PYTHONPATH=. python benchmarks/bench_data.py --gpu-images-per-sec 6671 --gpu-tokens-per-sec 215000 \
        --gpus-per-host 1

Prepares each source as `jaxdist data prepare` does, in a temporary directory, then reads train
batches through the pipeline `jaxdist train` uses (`stream.train_batches`: shuffled, per-epoch
reseeded, this process feeding every row) for each `data.workers` of the sweep and for the
default (`data.workers: auto`, resolved for one process on this host, marked "(auto)"):

- `text/byte`, `text/sentencepiece`: Python's standard library sources (`--text-mb` of them) as
  token shards, read as packed `--token-batch` x `--seq-len` windows (sentencepiece where it is
  installed);
- `images`: `--images` generated JPEG files in class folders, decoded and resized to
  `--image-size` pixels at prepare time (raw uint8 pixels in ArrayRecord shards), read as batches
  of `--image-batch` with the train augmentation (`--crop-padding`, flip).

Before the sweep it reads the image shards alone (no augmentation, no batching) for their raw
read rate. A rate is items per second of wall time; per core, per CPU-second of this process and
its workers together (user + system time, from /proc), so it holds on a machine others share;
`x need` is the rate over the named GPU rate times `--gpus-per-host` (what one process must
deliver to feed all of a host's GPUs). Runs with numpy, jax, grain, array_record and pillow only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.data import corpus, images, prepare, sources, stream
from jaxdist.data.augment import Augment
from jaxdist.parallel.feed import BatchRows

SWEEP = (0, 1, 2, 4, 8, 16)
# Of the generated images, this many differ; the others repeat their bytes (decode cost is what
# counts at prepare time, and the pipeline reads every record from the shards anyway).
DISTINCT_IMAGES = 64
# Image classes of the generated folder.
CLASSES = 8


@dataclass(frozen=True)
class Rate:
    """Items per second of wall time, and CPU-seconds the pipeline's processes used per second."""

    per_sec: float
    busy_cores: float

    @property
    def per_core(self) -> float:
        return self.per_sec / self.busy_cores if self.busy_cores else float("nan")


def cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of process `root` (default: this one) and all its descendants that
    are alive now (Linux /proc; each process's threads included)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
        pid, parent = int(entry), int(fields[1])
        children.setdefault(parent, []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def measure(batches: Iterator[dict], items: Callable[[dict], int], seconds: float, warmup: int) -> Rate:
    """The rate of `batches` over `seconds`, after `warmup` batches: enough to start the workers
    and empty the read-ahead they filled meanwhile, which would otherwise count as if read in the window."""
    for _ in range(warmup):
        next(batches)
    count, start, cpu = 0, time.perf_counter(), cpu_seconds()
    while time.perf_counter() - start < seconds:
        count += items(next(batches))
    elapsed = time.perf_counter() - start
    return Rate(count / elapsed, (cpu_seconds() - cpu) / elapsed)


def sweep_counts(cores: int) -> list[int]:
    """`SWEEP`'s worker counts that fit this machine (up to its usable cores)."""
    return [workers for workers in SWEEP if workers <= max(cores, 1)]


def utf8_stdlib_files(megabytes: float) -> list[str]:
    """The stdlib's non-empty UTF-8 .py files (some test files are deliberately not), about
    `megabytes` of them, spread over the whole library."""
    found = []
    for path in corpus.stdlib_files():
        try:
            size = len(path.read_text(encoding="utf-8").encode())
        except UnicodeDecodeError:
            continue
        if size:
            found.append((str(path), size))
    step = max(1, round(sum(size for _, size in found) / (megabytes * 1e6)))
    return [path for path, _ in found[::step]]


def generate_jpegs(folder: Path, count: int, rng: np.random.Generator) -> None:
    """`count` JPEG files (quality 90, 320 x 256, smooth shapes under mild noise) in `CLASSES` folders."""
    from PIL import Image

    y, x = np.mgrid[0:256, 0:320].astype(np.float32)
    encoded = []
    for _ in range(DISTINCT_IMAGES):
        frequency, phase, base = rng.uniform(0.005, 0.05, 3), rng.uniform(0, 6, 3), rng.uniform(40, 200, 3)
        waves = np.sin(x[..., None] * frequency + y[..., None] * frequency[::-1] + phase)
        pixels = base + 50 * waves + rng.normal(0, 6, (256, 320, 3))
        path = folder / "encoded.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        encoded.append(path.read_bytes())
    path.unlink()
    for index in range(count):
        directory = folder / "photos" / f"class{index % CLASSES}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{index:06d}.jpg").write_bytes(encoded[index % DISTINCT_IMAGES])


def raw_read(directory: Path, manifest: dict, seconds: float) -> tuple[float, float, float]:
    """(records/s, MB/s of record bytes, bytes on disk per record) of reading the train split's
    records in random order in this thread (decompressed, checked, no decoding into arrays)."""
    entry = manifest["splits"]["train"]
    reader = sources.RecordReader(directory, entry["files"], entry["records"])
    size = sources.LABEL_DTYPE.itemsize + int(np.prod(manifest["image_shape"]))
    order = np.random.default_rng(0).permutation(len(reader))
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        reader.read(int(order[count % len(order)]), size)
        count += 1
    rate = count / (time.perf_counter() - start)
    on_disk = sum((directory / name).stat().st_size for name in entry["files"]) / len(reader)
    return rate, rate * size / 1e6, on_disk


@dataclass
class Source:
    """One group of the table's rows: how to make its train batches and count their items."""

    name: str
    data_source: str  # its data.source, which data.workers: auto depends on
    unit: str
    batches: Callable[[int], Iterator[dict]]  # workers -> this process's train batches
    items: Callable[[dict], int]
    need: float | None  # items per second one process must deliver to feed the host's GPUs
    note: str = ""  # said again beside the table


def text_source(scratch: Path, tokenizer: str, args) -> Source | None:
    """`text/TOKENIZER` over the stdlib files; None (said why) where the tokenizer is not installed."""
    if tokenizer != "byte":
        try:
            __import__(tokenizer)
        except ImportError:
            print(f"text/{tokenizer}: skipped ({tokenizer} is not installed)")
            return None
    out = scratch / f"text-{tokenizer}"
    start = time.perf_counter()
    manifest = prepare.prepare(utf8_stdlib_files(args.text_mb), str(out), tokenizer=tokenizer,
                               vocab_size=args.vocab_size, eval_fraction=0.01)
    train = manifest["splits"]["train"]
    print(f"text/{tokenizer}: prepared {train['tokens'] / 1e6:.1f} M {manifest['dtype']} tokens of "
          f"{train['documents']} files in {time.perf_counter() - start:.1f} s", flush=True)
    windows = stream.TokenWindows(sources.ArrayRecordTokens(out, manifest, "train"), args.seq_len)
    rows = BatchRows(args.token_batch, tuple(range(args.token_batch)))
    return Source(
        f"text/{tokenizer}", "arrayrecord", "tokens",
        lambda workers: stream.train_batches(windows, rows, seed=0, workers=workers, read_threads=args.read_threads,
                                               prefetch=args.prefetch),
        lambda batch: batch["inputs"].size,
        args.gpu_tokens_per_sec * args.gpus_per_host if args.gpu_tokens_per_sec else None,
    )


def image_source(scratch: Path, args) -> Source:
    """`images`: generated JPEGs prepared at `--image-size`, read with the train augmentation."""
    start = time.perf_counter()
    generate_jpegs(scratch, args.images, np.random.default_rng(0))
    generated = time.perf_counter() - start
    out = scratch / "images"
    manifest = images.prepare(scratch / "photos", str(out), image_size=args.image_size, eval_fraction=0.01)
    print(f"images: generated {args.images} JPEGs in {generated:.1f} s, prepared them at "
          f"{args.image_size} x {args.image_size} in {time.perf_counter() - start - generated:.1f} s", flush=True)
    records, megabytes, on_disk = raw_read(out, manifest, args.seconds)
    record = sources.LABEL_DTYPE.itemsize + int(np.prod(manifest["image_shape"]))
    note = (f"images: {record:,} bytes per record (int32 label + uint8 pixels), {on_disk:,.0f} bytes per image on "
            f"disk (zstd); raw read, one thread, no augmentation: {records:,.0f} records/s, {megabytes:,.0f} MB/s")
    print(note)
    source = sources.ArrayRecordImages(out, manifest, "train")
    rows = BatchRows(args.image_batch, tuple(range(args.image_batch)))
    augment = Augment(seed=0, crop_padding=args.crop_padding, flip=True)
    return Source(
        "images", "images", "images",
        lambda workers: stream.train_batches(source, rows, seed=0, workers=workers, augment=augment,
                                               read_threads=args.read_threads, prefetch=args.prefetch),
        lambda batch: len(batch["labels"]),
        args.gpu_images_per_sec * args.gpus_per_host if args.gpu_images_per_sec else None,
        note,
    )


def run_sweep(source: Source, counts: list[int], cores: int, args) -> list[tuple[str, Rate]]:
    """(workers as shown, rate) for each count and the default (`data.workers: auto` for one process
    on `cores`), the default's marked."""
    default = stream.auto_workers(source.data_source, cores, processes=1)
    results = []
    for workers in sorted({*counts, default}):
        batches = source.batches(workers)
        # Each worker reads `prefetch` batches ahead and holds one more in its output queue.
        warmup = (workers or 1) * (args.prefetch + 1) + 2
        rate = measure(batches, source.items, args.seconds, warmup)
        batches.close()
        shown = f"{workers} (auto)" if workers == default else str(workers)
        results.append((shown, rate))
        print(f"{source.name}, {shown} workers: {amount(rate.per_sec)} {source.unit}/s, {rate.busy_cores:.1f} "
              f"cores busy, {amount(rate.per_core)} per core", flush=True)
    return results


def amount(value: float) -> str:
    return f"{value / 1e6:,.2f} M" if value >= 1e6 else f"{value:,.0f}"


def table(rows: list[tuple[Source, str, Rate]]) -> str:
    lines = ["| source | workers | per second | per core | x need |", "|---|---|---|---|---|"]
    for source, workers, rate in rows:
        multiple = f"{rate.per_sec / source.need:.2f}" if source.need else "-"
        lines.append(f"| {source.name} | {workers} | {amount(rate.per_sec)} {source.unit} | "
                     f"{amount(rate.per_core)} | {multiple} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-images-per-sec", type=float, help="images/s one GPU trains on (e.g. 6671)")
    parser.add_argument("--gpu-tokens-per-sec", type=float, help="tokens/s one GPU trains on (e.g. 215000)")
    parser.add_argument("--gpus-per-host", type=int, default=1)
    parser.add_argument("--workers", help="comma-separated worker counts (default: 0,1,2,4,8,16 up to the cores)")
    parser.add_argument("--sources", default="text/byte,text/sentencepiece,images")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured per row, after warm-up")
    parser.add_argument("--read-threads", type=int, default=2, help="data.read_threads")
    parser.add_argument("--prefetch", type=int, default=4, help="data.prefetch")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--image-batch", type=int, default=256)
    parser.add_argument("--crop-padding", type=int, default=16)
    parser.add_argument("--text-mb", type=float, default=4.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--token-batch", type=int, default=16)
    args = parser.parse_args()

    cores = stream.usable_cores()
    counts = [int(count) for count in args.workers.split(",")] if args.workers else sweep_counts(cores)
    print(f"{cores} usable cores; data.workers=auto gives one process on them "
          f"{stream.auto_workers('images', cores, 1)} workers for images, "
          f"{stream.auto_workers('arrayrecord', cores, 1)} for text; Python {sys.version.split()[0]}", flush=True)
    rows, measured = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.sources.split(","):
            source = image_source(Path(scratch), args) if name == "images" else text_source(
                Path(scratch), name.removeprefix("text/"), args)
            if source is not None:
                measured.append(source)
                rows += [(source, workers, rate) for workers, rate in run_sweep(source, counts, cores, args)]
    needs = dict.fromkeys(f"{amount(source.need)} {source.unit}/s" for source in measured if source.need)
    print()
    print("\n".join(source.note for source in measured if source.note))
    print(f"{cores} cores; x need: the rate over {', '.join(needs) or 'no named GPU rate'} "
          f"({args.gpus_per_host} GPU(s) per host); per core: per CPU-second of the process and its workers")
    print(table(rows))


if __name__ == "__main__":
    main()
