"""Grain pipelines: packed token windows, shuffled per epoch, each process reading the rows it feeds.

The global stream of examples is fixed by (seed, dataset): epoch e is a permutation seeded by
(seed, e). Global step s consumes examples [start + s * G, start + (s + 1) * G) of that stream
(G = global batch), row r of its batch being example start + s * G + r. A process reads the rows
its devices hold (`jaxdist.parallel.feed.BatchRows`): processes holding the same rows read the
same examples. So the data position is one number, the global example index, and it means the
same thing under any process count and layout.

Batches are made before grain's worker processes share out the work (each worker makes whole
batches, every n-th one), so the number of workers changes neither the batches nor their order:
a run resumes under any `data.workers`. `auto_workers` is what `data.workers: auto` resolves to.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grain
import numpy as np
from absl import flags

from jaxdist.parallel.feed import BatchRows
from jaxdist.errors import UserError


# data.workers=auto (`auto_workers`), measured in docs/performance.md: workers only for the sources
# whose examples take real work (a prepared image folder's records: unpacked, cropped, flipped;
# token windows read at millions of tokens/s per core, and in-memory arrays, stay in the
# training process); with fewer cores per training process none (on 2 cores, workers trained
# slower); with more, all but RESERVED_CORES (the training loop and JAX's own threads), at most MAX_WORKERS.
SOURCES_WITH_WORKERS = ("images",)
MIN_CORES_FOR_WORKERS = 4
RESERVED_CORES = 2
MAX_WORKERS = 32

# Orders the eval examples of a pass limited to its first batches (`eval_batches`).
EVAL_SAMPLE_SEED = 0


class TokenWindows:
    """Random-access source of packed windows: inputs = tokens[i*T : i*T+T], targets shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "the whole token stream"):
        if len(tokens) < seq_len + 1:
            raise UserError(
                f"model.seq_len={seq_len} is longer than {name} ({len(tokens)} tokens); "
                f"use a shorter model.seq_len or more data"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].astype(np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


class PackedDocuments:
    """Random-access source of rows packed whole documents, as many as fit, in stream order.

    A document is the tokens up to and including a `separator` (the stream's document boundary);
    its n tokens give n - 1 (input, target) pairs, and those pairs are what a row of `seq_len` holds.
    Documents go into the current row while they fit, the next starts a new row, and the row's rest
    is padding (segment 0, target 0, weight 0 in the loss); a document longer than a row fills rows
    of its own, each piece counted from position 0. Each row carries `segments` (1, 2, ... per
    document in the row) and `positions` (each token's place in its document), which the model turns
    into attention within each document. The plan is fixed by the stream alone, so row i is the
    same under any process count, worker count or resume: the data position stays one row index.

    The plan keeps the start and length of every piece: 16 bytes a document, computed when the
    source opens from one pass over the stream for its separators.
    """

    def __init__(self, tokens, seq_len: int, separator: int, name: str = "the whole token stream"):
        ends = _document_ends(tokens, separator)
        starts = np.concatenate([[0], ends[:-1]])
        pairs = ends - starts - 1
        keep = pairs > 0  # a lone separator predicts nothing
        starts, pairs = starts[keep], pairs[keep]
        if not len(starts):
            raise UserError(f"{name} holds no document of two or more tokens to pack")
        # Documents longer than a row become pieces of seq_len pairs (each a document of its own).
        pieces = -(-pairs // seq_len)
        piece_doc = np.repeat(np.arange(len(starts)), pieces)
        piece_index = np.arange(len(piece_doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.starts = starts[piece_doc] + piece_index * seq_len
        self.lengths = np.minimum(pairs[piece_doc] - piece_index * seq_len, seq_len)
        self.rows = _first_rows(self.lengths, seq_len)
        self.tokens, self.seq_len = tokens, seq_len
        self.documents = int(len(starts))
        self.padding = 1 - float(self.lengths.sum()) / (len(self) * seq_len)

    def __len__(self) -> int:
        return len(self.rows) - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = {key: np.zeros(self.seq_len, np.int32) for key in ("inputs", "targets", "segments", "positions")}
        at = 0
        for segment, piece in enumerate(range(self.rows[index], self.rows[index + 1]), 1):
            start, length = int(self.starts[piece]), int(self.lengths[piece])
            window = np.asarray(self.tokens[start : start + length + 1], np.int32)
            row["inputs"][at : at + length] = window[:-1]
            row["targets"][at : at + length] = window[1:]
            row["segments"][at : at + length] = segment
            row["positions"][at : at + length] = np.arange(length)
            at += length
        return row


def _document_ends(tokens, separator: int, chunk: int = 1 << 24) -> np.ndarray:
    """One past each document's last token: after each separator, and the stream's end. Read a
    chunk at a time, so a prepared split is never whole in memory."""
    ends = [np.flatnonzero(np.asarray(tokens[start:start + chunk]) == separator) + start + 1
            for start in range(0, len(tokens), chunk)]
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))  # a last document without its separator
    return ends


def _first_rows(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The first piece of every row when pieces of `lengths` fill rows of `seq_len` in order (a
    piece that does not fit the row's rest starts the next), and the piece count last."""
    firsts, used = [0], 0
    for piece, length in enumerate(lengths.tolist()):
        if used + length > seq_len:
            firsts.append(piece)
            used = 0
        used += length
    firsts.append(len(lengths))
    return np.asarray(firsts, np.int64)


class _RowsOf(grain.transforms.DatasetSelectionMap):
    """Local index -> (0, the stream index of that row of this process's batches)."""

    def __init__(self, rows: BatchRows, start: int, batches: int | None):
        self.rows, self.start = rows, start
        self.length = sys.maxsize if batches is None else batches * rows.local_batch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[int, int]:
        return 0, self.rows.example(index, self.start)


def _rows_of(stream: grain.MapDataset, rows: BatchRows, start: int = 0, batches: int | None = None) -> grain.MapDataset:
    """This process's batches of `stream`: `rows` of each global batch, from stream index `start` on."""
    mine = grain.MapDataset.select_from_datasets([stream], _RowsOf(rows, start, batches))
    return mine.batch(rows.local_batch, drop_remainder=True)


def train_batches(
    source,
    rows: BatchRows,
    seed: int,
    start_example: int = 0,
    read_threads: int = 2,
    prefetch: int = 4,
    workers: int = 0,
    augment: Callable[[int, dict], dict] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches of the endless, per-epoch-reshuffled stream, from `start_example` on.

    `augment(index, example)`, when given, changes each example as a function of its stream index
    (`jaxdist.data.augment.Augment`). `workers` > 0 reads in that many grain worker processes; the
    batches are the same. grain's workers read absl flags, so then absl's `FLAGS` are marked parsed
    if the program has not parsed them; with `workers=0` (the default) absl is left untouched.
    """
    stream = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    if augment is not None:
        stream = stream.map_with_index(augment)  # the index here is the global example index
    return _iterate(_rows_of(stream, rows, start_example), read_threads, prefetch, workers)


class _WeightedRow:
    """Index -> example with `weights` 1, or (past the end) a repeated example with `weights` 0."""

    def __init__(self, source):
        self.source = source

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        real = index < len(self.source)
        return {**self.source[index % len(self.source)], "weights": np.float32(real)}


def eval_batches(
    source,
    rows: BatchRows,
    max_batches: int | None = None,
    read_threads: int = 2,
    prefetch: int = 4,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's share of one in-order pass over `source`, every example exactly once.

    Global batch b holds examples [b * G, (b + 1) * G) (G = `rows.global_batch`); the process
    reads the rows it feeds. The last batch is filled up with `weights` 0 rows, so a metric
    weighted by `weights` is exact. `max_batches`, when fewer than the pass, reads that many global
    batches of the examples in a fixed shuffled order instead (`EVAL_SAMPLE_SEED`, never the train
    seed: every run, resume and process samples the same examples).
    """
    count = -(-len(source) // rows.global_batch)
    if max_batches is not None and max_batches < count:
        # Prepared data is stored class by class or document by document: a prefix in that order
        # would evaluate the first classes or documents only.
        source, count = grain.MapDataset.source(source).shuffle(seed=EVAL_SAMPLE_SEED), max_batches
    padded = grain.MapDataset.range(count * rows.global_batch).map(_WeightedRow(source))
    return _iterate(_rows_of(padded, rows, batches=count), read_threads, prefetch, workers=0)


def _iterate(batches: grain.MapDataset, read_threads: int, prefetch: int, workers: int) -> Iterator:
    """`batches` (a batched MapDataset), read ahead by threads, in worker processes where `workers`."""
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    stream = batches.to_iter_dataset(options)
    if workers:
        # Only here, where the caller asked for workers: grain's worker processes read absl flags,
        # and a program that never parsed any must say so; without workers absl stays as it was.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        stream = stream.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)).map(_in_own_memory)
    return iter(stream)


def _in_own_memory(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A worker's batch copied out of the shared memory grain hands it over in.

    grain unlinks a batch's shared memory when the array that maps it is deleted, on a thread of its
    own, and JAX may keep a host array it was given (`jax.device_put`) until Python's next garbage
    collection: a run's last batches would outlive the process ("leaked shared_memory objects" at
    exit). The copy, one memcpy of the batch, frees the shared memory as soon as the batch arrives.
    """
    return {key: np.array(value) for key, value in batch.items()}


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may use: its CPU affinity, capped by a CPU quota of its control group
    (a container's CPU limit: cgroup v2's `cpu.max`, or v1's `cpu/cpu.cfs_quota_us` per period)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            quota, *period = (cgroup / quota_file).read_text().split()
            if period_file is not None:
                period = (cgroup / period_file).read_text().split()
            if quota not in ("max", "-1"):
                cores = min(cores, max(1, math.ceil(int(quota) / int(period[0]))))
        except (OSError, ValueError, IndexError):  # no such file, or not a quota
            continue
    return cores


def auto_workers(source: str, cores: int, processes: int) -> int:
    """`data.workers: auto`: the grain worker processes reading `source` (a `data.source`) for each of
    `processes` training processes that share `cores` CPU cores: none for a source not in
    `SOURCES_WITH_WORKERS` or below `MIN_CORES_FOR_WORKERS` cores each, else all of a process's
    cores but `RESERVED_CORES`, at most `MAX_WORKERS`."""
    share = cores // max(processes, 1)
    if source not in SOURCES_WITH_WORKERS or share < MIN_CORES_FOR_WORKERS:
        return 0
    return min(share - RESERVED_CORES, MAX_WORKERS)
