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
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.parallel import batch_stats


class BatchNorm(nnx.Module):
    """Normalizes over all but the last dimension; a learned scale and offset per feature.

    `momentum` is the running averages' decay per update (PyTorch's momentum 0.1 is 0.9 here).
    """

    def __init__(self, features: int, names: Sequence[str | None], *, momentum: float = 0.9,
                 epsilon: float = 1e-5, param_dtype=jnp.float32):
        names = tuple(names)
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), out_sharding=names)
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), out_sharding=names)
        self.mean = nnx.BatchStat(jnp.zeros((features,), jnp.float32), out_sharding=names)
        self.var = nnx.BatchStat(jnp.ones((features,), jnp.float32), out_sharding=names)
        self.momentum = momentum
        self.epsilon = epsilon
        self.use_running_average = False

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        if self.use_running_average:
            mean, var = self.mean[...], self.var[...]
        else:
            mean, mean_of_squares = batch_stats.means((x32, jnp.square(x32)), range(x.ndim - 1))
            var = jnp.maximum(mean_of_squares - jnp.square(mean), 0.0)
            self.mean[...] = jax.lax.stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
            self.var[...] = jax.lax.stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * var)
        scale = self.scale[...].astype(jnp.float32) * jax.lax.rsqrt(var + self.epsilon)
        return ((x32 - mean) * scale + self.bias[...].astype(jnp.float32)).astype(x.dtype)
