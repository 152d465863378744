"""The experts' grouped matmul: rows sorted by expert, each expert's rows times its own matrix.

`grouped(x, w, groups)` is `jax.lax.ragged_dot(x, w, groups)`: x (rows, k), w (experts, k, n),
`groups[e]` rows for expert e in order, rows after them 0. XLA's GPU compiler lowers `ragged_dot`
as one dense matmul per expert over all the rows (E times the FLOPs and the memory: 102 TFLOP/s
on one H200 for the 5B mixture's up projection, benchmarks/reports/2026-12-02-moe-one-gpu.md), so
on Hopper GPUs the products are jax's Pallas Mosaic GPU kernels instead
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, `transposed_ragged_dot_mgpu`: 620-700 TFLOP/s
there), under one custom VJP whose backward is two more grouped products: the rows' gradient
`dy @ w[e]^T` (the same kernel, its matrix transposed) and the weights' `x_e^T dy_e` (the
transposed kernel, which sums over each expert's rows). The kernel leaves rows after the groups
unwritten; they are set to 0 here, as `ragged_dot` gives them.

Elsewhere, and for shapes the kernels don't take (both matrix sides multiples of 128, a 16-bit
dtype), `ragged_dot` runs as XLA has it. Jax's kernels have no interpreter path, so the CPU tests
check the custom VJP's algebra with XLA's products in the kernels' place (`products`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.kernels import mosaic, switch

# Tiles of the kernels: the fastest on one H200 for the 5B mixture's six products (2,048 x 5,632
# and back, 32,768 rows; benchmarks/reports/2026-12-02-moe-one-gpu.md).
BLOCK = 128
BLOCK_K = 64
STAGES, TRANSPOSED_STAGES = 6, 4
ROW_TILE = 8  # the kernels' row count must be a multiple of it


def unsupported(k: int, n: int, dtype) -> str | None:
    """Why the kernels can't take a grouped product of (rows, k) by (experts, k, n) in `dtype`, or None."""
    reason = "jax's grouped-matmul kernels run on a GPU only" if mosaic.interpreting() else mosaic.unavailable()
    if reason is not None:
        return reason
    if jnp.dtype(dtype).itemsize != 2:
        return f"the kernels take 16-bit operands, not {jnp.dtype(dtype).name}"
    if k % BLOCK or n % BLOCK:
        return f"both matrix sides ({k} x {n}) must be multiples of {BLOCK}"
    return None


def use_kernel(impl: str, k: int, n: int, dtype) -> bool:
    """Whether `model.impl.grouped_matmul_impl` = `impl` runs the kernels on (k, n) experts' matrices."""
    return switch.wanted(impl) and switch.decide(
        "grouped_matmul_impl", impl, unsupported(k, n, dtype), "the experts run as XLA's ragged_dot")


def grouped(x: jax.Array, w: jax.Array, groups: jax.Array, impl: str = "auto") -> jax.Array:
    """`ragged_dot(x, w, groups)` in x's dtype, by jax's kernels where `impl` asks and they apply."""
    if use_kernel(impl, w.shape[1], w.shape[2], x.dtype):
        rows = x.shape[0]
        padded = jnp.pad(x, ((0, -rows % ROW_TILE), (0, 0)))  # the rows after the groups count for nothing
        return _grouped_vjp(KERNELS, padded, w.astype(x.dtype), groups)[:rows]
    return jax.lax.ragged_dot(x, w, groups, preferred_element_type=x.dtype)


class Products(NamedTuple):
    """The three grouped products of the forward and backward: `forward(x, w, groups)` (rows, n);
    `transposed_rhs(dy, w, groups)` dy @ w[e]^T (rows, k); `per_group(x, dy, groups)` (experts, k, n)."""

    forward: object
    transposed_rhs: object
    per_group: object


def _rows_after_groups_zero(out: jax.Array, groups: jax.Array) -> jax.Array:
    return jnp.where((jnp.arange(out.shape[0]) < groups.sum())[:, None], out, 0)


def _grid_block_n(n: int) -> int:
    return next(g for g in (4, 2, 1) if (n // BLOCK) % g == 0)


def _kernel(lhs, rhs, groups, transpose_rhs: bool = False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=groups, block_m=BLOCK, block_n=BLOCK, block_k=BLOCK_K,
                                     max_concurrent_steps=STAGES, grid_block_n=_grid_block_n(n),
                                     transpose_rhs=transpose_rhs)
    return _rows_after_groups_zero(out, groups)


def _kernel_per_group(x, dy, groups):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x, dy, group_sizes=groups, block_m=BLOCK, block_n=BLOCK, block_k=BLOCK_K,
        max_concurrent_steps=TRANSPOSED_STAGES, grid_block_n=_grid_block_n(dy.shape[1]))


KERNELS = Products(_kernel, functools.partial(_kernel, transpose_rhs=True), _kernel_per_group)

_PER_GROUP = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                               lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
XLA = Products(
    lambda x, w, groups: jax.lax.ragged_dot(x, w, groups, preferred_element_type=x.dtype),
    lambda dy, w, groups: jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), groups, preferred_element_type=dy.dtype),
    lambda x, dy, groups: jax.lax.ragged_dot_general(x, dy, groups, _PER_GROUP, preferred_element_type=x.dtype),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_vjp(products: Products, x, w, groups):
    return products.forward(x, w, groups)


def _forward(products, x, w, groups):
    return products.forward(x, w, groups), (x, w, groups)


def _backward(products, residuals, dy):
    x, w, groups = residuals
    dy = dy.astype(x.dtype)  # rows after the groups take no part: ragged_dot gave them 0
    dx = products.transposed_rhs(dy, w, groups)
    dw = products.per_group(x, dy, groups).astype(w.dtype)
    return dx, dw, np.zeros(groups.shape, jax.dtypes.float0)


_grouped_vjp.defvjp(_forward, _backward)


def grouped_with(products: Products, x: jax.Array, w: jax.Array, groups: jax.Array) -> jax.Array:
    """`ragged_dot(x, w, groups)` under the custom VJP with `products` (tests: XLA's in the kernels' place)."""
    return _grouped_vjp(products, x, w, groups)
