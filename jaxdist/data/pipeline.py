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
from jax.sharding import NamedSharding

from jaxdist.errors import UserError


class TokenWindows:
    """Random-access source of packed windows: inputs = tokens[i*T : i*T+T], targets shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise UserError(
                f"model.seq_len={seq_len} is longer than the whole token stream ({len(tokens)} tokens); "
                f"use a shorter sequence or more data"
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
) -> Iterator[dict[str, np.ndarray]]:
    """This process's batches of the endless, per-epoch-reshuffled stream, from `start_example` on."""
    stream = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    mine = stream[start_example + process_index :: process_count]
    batches = mine.batch(local_batch, drop_remainder=True)
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    return iter(batches.to_iter_dataset(options))


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assembles each process's local rows into one global `jax.Array` per key."""
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}
