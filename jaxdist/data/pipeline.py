"""Grain pipelines: packed token windows, shuffled per epoch, each process reading its share.

The global stream of examples is fixed by (seed, dataset): epoch e is a permutation seeded by
(seed, e). Global step s consumes examples [s * global_batch, (s + 1) * global_batch) of that
stream; process p of P reads every P-th of them. So the data position is one number, the global
example index, and it means the same thing under any process count.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import jax
import numpy as np
from absl import flags
from jax.sharding import NamedSharding

from jaxdist.errors import UserError


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


def train_batches(
    source,
    local_batch: int,
    seed: int,
    start_example: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    read_threads: int = 2,
    prefetch: int = 4,
    workers: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches of the endless, per-epoch-reshuffled stream, from `start_example` on.

    `workers` > 0 reads in that many grain worker processes; the batches are the same. grain's
    workers read absl flags, so then absl's `FLAGS` are marked parsed if the program has not parsed
    them; with `workers=0` (the default) absl is left untouched.
    """
    stream = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    mine = stream[start_example + process_index :: process_count]
    batches = mine.batch(local_batch, drop_remainder=True)
    return _iterate(batches, read_threads, prefetch, workers)


class _WeightedRow:
    """Index -> example with `weights` 1, or (past the end) a repeated example with `weights` 0."""

    def __init__(self, source):
        self.source = source

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        real = index < len(self.source)
        return {**self.source[index % len(self.source)], "weights": np.float32(real)}


def eval_batches(
    source,
    local_batch: int,
    process_index: int = 0,
    process_count: int = 1,
    max_batches: int | None = None,
    read_threads: int = 2,
    prefetch: int = 4,
) -> Iterator[dict[str, np.ndarray]]:
    """This process's share of one in-order pass over `source`, every example exactly once.

    Global batch b holds examples [b * G, (b + 1) * G) with G = local_batch * process_count;
    process p reads every P-th. The last batch is filled up with `weights` 0 rows, so a metric
    weighted by `weights` is exact. `max_batches` stops after that many global batches.
    """
    global_size = local_batch * process_count
    count = -(-len(source) // global_size)
    if max_batches is not None:
        count = min(count, max_batches)
    rows = grain.MapDataset.range(count * global_size)[process_index::process_count]
    return _iterate(rows.map(_WeightedRow(source)).batch(local_batch), read_threads, prefetch, workers=0)


def _iterate(batches: grain.MapDataset, read_threads: int, prefetch: int, workers: int) -> Iterator:
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    stream = batches.to_iter_dataset(options)
    if workers:
        # Only here, where the caller asked for workers: grain's worker processes read absl flags,
        # and a program that never parsed any must say so; without workers absl stays as it was.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        stream = stream.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(stream)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assembles each process's local rows into one global `jax.Array` per key."""
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}
