"""The hand-written LayerNorm/RMSNorm backward: autodiff's gradients, from half the saved bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.models import norm

ROWS, WIDTH = (4, 6), 64


def _reference(x, scale, bias):
    """The textbook formula in float32, differentiated by JAX."""
    x32 = x.astype(jnp.float32)
    if bias is not None:
        x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + norm.EPS) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


def _custom(x, scale, bias):
    return norm.rms_norm(x, scale) if bias is None else norm.layer_norm(x, scale, bias)


def _inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    x = (3.0 * jax.random.normal(keys[0], (*ROWS, WIDTH)) + 0.7).astype(dtype)
    scale = 1.0 + 0.2 * jax.random.normal(keys[1], (WIDTH,))
    bias = 0.1 * jax.random.normal(keys[2], (WIDTH,))
    upstream = jax.random.normal(keys[3], (*ROWS, WIDTH))  # a non-trivial cotangent
    return x, scale, bias, upstream


def _grads(fn, x, scale, bias, upstream):
    loss = lambda x, s, b: jnp.sum(fn(x, s, b).astype(jnp.float32) * upstream)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_float32_values_and_gradients_equal_autodiff(kind):
    x, scale, bias, upstream = _inputs(jnp.float32)
    bias = bias if kind == "layernorm" else None
    np.testing.assert_allclose(_custom(x, scale, bias), _reference(x, scale, bias), rtol=1e-6, atol=1e-6)
    got, want = _grads(_custom, x, scale, bias, upstream), _grads(_reference, x, scale, bias, upstream)
    for name, g, w in zip(("x", "scale", "bias"), got, want):
        if w is None:
            assert g is None
            continue
        assert float(jnp.abs(w).max()) > 0.1, name  # a real gradient, not zeros
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)


def test_bfloat16_input_gives_bfloat16_output_and_input_gradient_close_to_autodiff():
    x, scale, bias, upstream = _inputs(jnp.bfloat16)
    y = norm.layer_norm(x, scale, bias)
    assert y.dtype == jnp.bfloat16
    got, want = _grads(_custom, x, scale, bias, upstream), _grads(_reference, x, scale, bias, upstream)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    # Both compute in float32 from the same bfloat16 input: they differ by bfloat16 rounding only.
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def _saved_bytes(fn, x, scale, bias) -> int:
    """Bytes of the residuals that `jax.vjp` keeps for the backward pass."""
    _, pullback = jax.vjp(fn, x, scale, bias)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "nbytes"))


def test_backward_keeps_the_bfloat16_input_and_row_statistics_only():
    x, scale, bias, _ = _inputs(jnp.bfloat16)
    rows = int(np.prod(ROWS))
    kept = _saved_bytes(norm.layer_norm, x, scale, bias)
    # x in bfloat16, the float32 mean and 1/std per row, and the (float32) scale and bias.
    assert kept == x.nbytes + 2 * 4 * rows + 2 * 4 * WIDTH
    assert _saved_bytes(_reference, x, scale, bias) >= 1.9 * x.nbytes  # autodiff keeps float32 rows
