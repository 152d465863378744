"""LayerNorm and RMSNorm, in float32, with the residual add before them fused on GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.kernels import fused_norm
from jaxdist.models.layers.common import RESIDUAL, param
from jaxdist.parallel import roles

if TYPE_CHECKING:
    from jaxdist.models.gpt.config import GPTConfig, ImplConfig


def scale_init(cfg: GPTConfig):
    """A norm scale's initializer: ones, or zeros where the parameter is the scale less 1."""
    return nnx.initializers.zeros_init() if cfg.norm_plus_one else nnx.initializers.ones_init()


def scale_of(parameter: jax.Array, plus_one: bool) -> jax.Array:
    """The scale a norm multiplies by: its parameter, or 1 + it (in float32) with `plus_one`."""
    return 1.0 + parameter.astype(jnp.float32) if plus_one else parameter


class Norm(nnx.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale), computed in float32; with `model.norm_plus_one`
    the parameter is the scale's difference from 1 (Gemma's), added to 1 in float32.

    `add(x, delta)` also adds a residual branch first; on GPU both run as fused Pallas kernels
    (`model.impl.norm_impl`, kernels/fused_norm.py), elsewhere as plain XLA.
    """

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs):
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.impl = impl.norm_impl
        self.plus_one = cfg.norm_plus_one
        self.scale = param(rngs, scale_init(cfg), (cfg.d_model,), ("embed",), param_dtype, roles.NORM)
        if cfg.norm == "layernorm":
            self.bias = param(rngs, nnx.initializers.zeros_init(), (cfg.d_model,), ("embed",), param_dtype, roles.NORM)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._fused(x):
            return fused_norm.norm(x, self._scale(), self._bias(), rms=self.kind == "rmsnorm", eps=self.eps, names=RESIDUAL)
        return self._xla(x)

    def add(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """`(x + delta, norm(x + delta))`: the next residual and its normed rows (`delta` None: no add)."""
        if delta is None:
            return x, self(x)
        if self._fused(x):
            return fused_norm.add_norm(x, delta, self._scale(), self._bias(), rms=self.kind == "rmsnorm",
                                       eps=self.eps, names=RESIDUAL)
        total = x + delta
        return total, self._xla(total)

    def _fused(self, x: jax.Array) -> bool:
        return fused_norm.use_kernel(self.impl, x, RESIDUAL)

    def _scale(self) -> jax.Array:
        return scale_of(self.scale[...], self.plus_one)

    def _bias(self) -> jax.Array | None:
        return self.bias[...] if self.kind == "layernorm" else None

    def _xla(self, x: jax.Array) -> jax.Array:
        y = fused_norm.normalize(x.astype(jnp.float32), self.kind == "rmsnorm", self.eps)[0] * self._scale()
        if self.kind == "layernorm":
            y = y + self.bias[...]
        return y.astype(x.dtype)
