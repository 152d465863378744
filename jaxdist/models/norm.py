"""LayerNorm and RMSNorm with a hand-written backward pass.

Statistics are float32 whatever the activation dtype. The backward keeps only the input (in its
own, usually bfloat16, dtype) and the per-row float32 mean and reciprocal standard deviation, as
fused LayerNorm kernels do: autodiff of the float32 formula keeps float32 copies of the centered
input instead, twice the bytes of every norm's input held for the backward pass, and reads them
back in more passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

EPS = 1e-5


def _stats(x: jax.Array, centered: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(float32 input, per-row mean (0 for RMSNorm), per-row 1/std), both kept with a trailing 1."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True) if centered else jnp.zeros(x.shape[:-1] + (1,), jnp.float32)
    xc = x32 - mean
    return x32, mean, jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + EPS)


def _forward(x, scale, bias, centered):
    x32, mean, rstd = _stats(x, centered)
    y = (x32 - mean) * rstd * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), (x, mean, rstd, scale, bias)


def _backward(centered, residuals, dy):
    x, mean, rstd, scale, bias = residuals
    xhat = (x.astype(jnp.float32) - mean) * rstd
    dy32 = dy.astype(jnp.float32)
    rows = tuple(range(x.ndim - 1))
    d_scale = jnp.sum(dy32 * xhat, axis=rows).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(dy32, axis=rows).astype(bias.dtype)
    g = dy32 * scale
    # d/dx of (x - mean) * rstd, applied to g: remove g's mean (LayerNorm only) and its xhat component.
    dx = g - jnp.mean(g * xhat, -1, keepdims=True) * xhat
    if centered:
        dx = dx - jnp.mean(g, -1, keepdims=True)
    return (dx * rstd).astype(x.dtype), d_scale, d_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, scale, bias, centered):
    return _forward(x, scale, bias, centered)[0]


_norm.defvjp(lambda x, scale, bias, centered: _forward(x, scale, bias, centered), _backward)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """(x - mean) / std * scale + bias over the last axis; output in x's dtype."""
    return _norm(x, scale, bias, True)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / rms(x) * scale over the last axis; output in x's dtype."""
    return _norm(x, scale, None, False)
