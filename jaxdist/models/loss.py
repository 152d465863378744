"""A loss as a weighted sum and its weight, so that any split of a batch gives the same mean.

A loss function returns `Loss(total, weight, metrics)`: `total` the weighted sum of the batch's
losses (tokens that count, examples), `weight` the sum of their weights, `metrics` other weighted
sums averaged by the same weight (accuracy). Whoever splits a batch (microbatches, batch shards,
processes, pipelines) adds up the parts' totals and weights and divides once by the global weight:
the mean is the same at any split, never a mean of per-part means (which weighs a token of a
padded or sparsely packed part more than one of a full part).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Loss(NamedTuple):
    """A batch's loss: `total` (float32 weighted sum), `weight` (the weights' sum) and `metrics`
    (other weighted sums, each divided by `weight` when reported)."""

    total: jax.Array
    weight: jax.Array
    metrics: dict[str, jax.Array] = {}

    @property
    def mean(self) -> jax.Array:
        """`total / weight`; 0 where the weight is 0 (a part that holds no counted token)."""
        return self.total / jnp.where(self.weight > 0, self.weight, 1)


def as_loss(out: Any, batch: dict[str, jax.Array]) -> Loss:
    """A loss function's result as a `Loss`. A plain scalar, or `(scalar, {name: metric})`, is taken
    as a mean over the batch's rows, each row of weight 1 (exact only where every row counts the
    same: padded or packed rows need a `Loss`)."""
    if isinstance(out, Loss):
        return Loss(out.total.astype(jnp.float32), jax.lax.stop_gradient(jnp.asarray(out.weight, jnp.float32)),
                    {name: value.astype(jnp.float32) for name, value in out.metrics.items()})
    mean, metrics = out if isinstance(out, tuple) else (out, {})
    rows = jnp.float32(jax.tree.leaves(batch)[0].shape[0])
    return Loss(mean.astype(jnp.float32) * rows, rows,
                {name: value.astype(jnp.float32) * rows for name, value in metrics.items()})
