"""BatchNorm whose statistics are always the whole batch's (SyncBatchNorm), with logical names.

In training the mean and variance over every dimension but the last (features) come from
`parallel.batch_stats.means`: over the global batch, across all devices and processes, also
inside the per-shard gradient vmap where flax's `nnx.BatchNorm` would need its `axis_name` fixed
when the model is built. The running averages are `nnx.BatchStat` variables that carry logical
names, so the rules shard them like the parameters and the train state holds, checkpoints and
restores them (`TrainState.model_state`). In eval mode (`model.eval()`, flax's switch of
`use_running_average`) the running averages normalize and nothing is updated.

Statistics and the normalization are float32 whatever the compute dtype; the variance is
E[x^2] - E[x]^2, clipped at 0, as flax computes it by default (one reduction for both moments).

The training pass has its gradient written out (`normalize`, a custom_vjp), with the ReLU that
follows most BatchNorms inside it: the backward reads the input and the output's gradient once
for both per-feature sums, and once more to write the input's gradient, and keeps nothing but the
input and two numbers per feature (the ReLU's mask is recomputed). Autodiff of the formula makes
more passes over memory (docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.parallel import batch_stats, roles


class BatchNorm(nnx.Module):
    """Normalizes over all but the last dimension; a learned scale and offset per feature.

    `momentum` is the running averages' decay per update (PyTorch's momentum 0.1 is 0.9 here).
    """

    def __init__(self, features: int, names: Sequence[str | None], *, momentum: float = 0.9,
                 epsilon: float = 1e-5, param_dtype=jnp.float32):
        names = tuple(names)
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), out_sharding=names, role=roles.NORM)
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), out_sharding=names, role=roles.NORM)
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32), out_sharding=names)
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32), out_sharding=names)
        self.momentum = momentum
        self.epsilon = epsilon
        self.use_running_average = False

    def __call__(self, x: jax.Array, relu: bool = False) -> jax.Array:
        """Normalized `x`, scaled and offset; with `relu`, max(that, 0)."""
        if self.use_running_average:
            scale = self.scale[...].astype(jnp.float32) * jax.lax.rsqrt(self.var[...] + self.epsilon)
            y = (x.astype(jnp.float32) - self.mean[...]) * scale + self.bias[...].astype(jnp.float32)
            return (jnp.maximum(y, 0.0) if relu else y).astype(x.dtype)
        y, mean, var = normalize(x, self.scale[...], self.bias[...], self.epsilon, relu)
        self.mean[...] = self.momentum * self.mean[...] + (1 - self.momentum) * mean
        self.var[...] = self.momentum * self.var[...] + (1 - self.momentum) * var
        return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def normalize(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float,
              relu: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """BatchNorm's training pass over all but the last dimension of `x`, by the whole batch's
    statistics (`batch_stats.means`): (output in x's dtype, the batch mean, its variance); with
    `relu`, the output is max(output, 0). The mean and variance carry no gradient."""
    return _normalize_fwd(x, scale, bias, epsilon, relu)[0]


def _normalize_fwd(x, scale, bias, epsilon, relu):
    x32 = x.astype(jnp.float32)
    mean, mean_of_squares = batch_stats.means((x32, jnp.square(x32)), range(x.ndim - 1))
    var = jnp.maximum(mean_of_squares - jnp.square(mean), 0.0)
    inv_std = jax.lax.rsqrt(var + epsilon)
    y = (x32 - mean) * (scale.astype(jnp.float32) * inv_std) + bias.astype(jnp.float32)
    if relu:
        y = jnp.maximum(y, 0.0)
    return (y.astype(x.dtype), mean, var), (x, mean, inv_std, scale, bias)


def _normalize_bwd(epsilon, relu, residuals, cotangents):
    x, mean, inv_std, scale, bias = residuals
    axes = tuple(range(x.ndim - 1))
    d_y = cotangents[0].astype(jnp.float32)  # the mean's and variance's are zero: stop_gradient'ed
    x_hat = (x.astype(jnp.float32) - mean) * inv_std
    if relu:
        d_y = jnp.where(x_hat * scale.astype(jnp.float32) + bias.astype(jnp.float32) > 0, d_y, 0.0)
    d_scale, d_bias = (d_y * x_hat).sum(axes), d_y.sum(axes)
    # Through the statistics, each row's gradient depends on the whole batch's: the means of both
    # sums' terms over it (across the batch shards too, as the forward's statistics).
    mean_d_y, mean_d_y_x_hat = batch_stats.means((d_y, d_y * x_hat), axes)
    d_x = (scale.astype(jnp.float32) * inv_std) * (d_y - mean_d_y - x_hat * mean_d_y_x_hat)
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(bias.dtype)


normalize.defvjp(_normalize_fwd, _normalize_bwd)
