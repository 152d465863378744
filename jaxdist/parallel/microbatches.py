"""Splitting a batch into microbatches and back, without moving rows between devices.

Gradient accumulation (train/accumulate.py) and the pipeline (parallel/pipeline.py) both scan
over microbatches of the global batch. Each microbatch takes every M-th row, so every device's
rows of a microbatch are rows it already holds.
"""

from __future__ import annotations

import jax

from jaxdist.parallel import rules as rules_lib


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """(B, ...) -> (microbatches, B / microbatches, ...), each microbatch a slice of every shard.

    Rows are taken strided, so the split moves no data between devices.
    """
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
    return rules_lib.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: (M, B / M, ...) -> (B, ...)."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
