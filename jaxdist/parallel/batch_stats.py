"""Means over the whole batch, for statistics a model computes from it (BatchNorm's: SyncBatchNorm).

Under jit with a sharded batch, a mean over the batch dimension already covers every row on every
device and process: XLA's partitioner turns it into local sums and an all-reduce over the mesh axes
that split the batch. The one place a model sees only part of the batch is the per-shard gradient
of `train.grad_reduction: per_step` with several microbatches (train/accumulate.py), a `vmap` over
the batch shards. There the step enters `across_shards(axis_name)`, and `means` averages over that
vmapped axis too, so the statistics are still those of the whole (micro)batch, never a shard's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

_SHARD_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxdist_batch_shard_axis", default=None)


@contextlib.contextmanager
def across_shards(axis_name: str) -> Iterator[None]:
    """While a function of one batch shard is traced inside `vmap(..., axis_name=axis_name)` over
    the shards, `means` also averages over that axis."""
    token = _SHARD_AXIS.set(axis_name)
    try:
        yield
    finally:
        _SHARD_AXIS.reset(token)


def means(values: Sequence[jax.Array], axes: Sequence[int]) -> list[jax.Array]:
    """The mean of each of `values` over `axes` (the batch dimension among them) across the whole
    batch; one cross-shard reduction for all of them where the shards are vmapped."""
    local = [value.mean(axis=tuple(axes)) for value in values]
    axis_name = _SHARD_AXIS.get()
    if axis_name is None:
        return local
    return list(jax.lax.pmean(jnp.stack(local), axis_name))
