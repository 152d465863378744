"""Dynamic loss scaling for float16 (the dtype policy itself: `jaxdist.models.dtypes`).

float16 has a narrow exponent range: small gradients flush to zero. Dynamic loss scaling
multiplies the loss by a large scale before differentiation and divides the float32 gradients by
it afterwards. When any gradient is not finite the step is skipped (parameters and optimizer
state kept) and the scale halves; after `period` clean steps in a row it doubles. The state is a
small pytree inside `TrainState`, so it is checkpointed with the rest.

`verdict` decides, in every precision, whether a step's update is applied and whether the step is
bad (non-finite for a reason the loss scale cannot explain: the run halts or counts it).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxdist.config import PrecisionConfig
from jaxdist.models.dtypes import compute_dtype_name


def uses_loss_scaling(precision: PrecisionConfig, backend: str | None = None) -> bool:
    """Dynamic loss scaling is on when asked for, or by default for float16 compute."""
    if precision.loss_scale == "auto":
        return compute_dtype_name(precision, backend) == "float16"
    return precision.loss_scale == "dynamic"


class LossScale(flax.struct.PyTreeNode):
    """Dynamic loss-scale state: the scale and the clean steps since its last change (skipped steps
    are counted in `TrainState.skipped_steps`, with every other skip)."""

    scale: jax.Array
    clean_steps: jax.Array
    period: int = flax.struct.field(pytree_node=False, default=2000)

    @classmethod
    def create(cls, initial_scale: float, period: int) -> LossScale:
        return cls(
            scale=jnp.asarray(initial_scale, jnp.float32),
            clean_steps=jnp.zeros((), jnp.int32),
            period=period,
        )

    def adjust(self, finite: jax.Array) -> LossScale:
        """The state after a step: halve if not finite; double after `period` clean steps."""
        grown = self.clean_steps + 1 >= self.period
        scale = jnp.where(finite, jnp.where(grown, self.scale * 2, self.scale), jnp.maximum(self.scale / 2, 1.0))
        clean = jnp.where(finite & ~grown, self.clean_steps + 1, 0)
        return self.replace(
            scale=scale.astype(jnp.float32),
            clean_steps=clean.astype(jnp.int32),
        )


def initial_loss_scale(precision: PrecisionConfig, backend: str | None = None) -> LossScale | None:
    """The starting loss-scale state for this config, or None when loss scaling is off."""
    if not uses_loss_scaling(precision, backend):
        return None
    return LossScale.create(precision.loss_scale_init, precision.loss_scale_period)


def keep_if_not_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the step was finite, else `old`, leaf by leaf (no control flow, no copy of `old`)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def verdict(loss: jax.Array, grad_norm: jax.Array, scale: LossScale | None) -> tuple[jax.Array, jax.Array]:
    """(apply, bad) for one step, from its loss and gradient norm (scalar bools).

    A non-finite gradient makes the norm non-finite, so the norm the step reports anyway is the
    whole check over the gradients, with no extra pass (a norm that overflows float32, from
    gradients of about 1e19, counts as non-finite too). `apply`: the loss and the norm are finite.
    `bad`: not applied, except that under dynamic loss scaling a gradient overflow with a finite
    loss is the scaler's business (the scale halves) while the scale is above its minimum of 1; at
    1 there is no scale left to blame, and a non-finite loss (computed unscaled) is bad at any scale.
    """
    finite_loss, finite_grads = jnp.isfinite(loss), jnp.isfinite(grad_norm)
    apply = finite_loss & finite_grads
    if scale is None:
        return apply, ~apply
    return apply, ~finite_loss | (~finite_grads & (scale.scale <= 1.0))
