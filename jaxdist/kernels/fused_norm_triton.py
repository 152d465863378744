"""The fused norms' kernels on Pallas's Triton backend (the interface of fused_norm_mosaic.py).

The backend is deprecated since jax 0.11 and to be removed; while a jax has it, fused_norm.py
prefers these kernels for rows over 1024 features (benchmarks/reports/2026-11-27-first-start.md). The forward takes
8 rows per program; the backward 512 programs that each walk their rows 4 at a time, keeping the
scale/bias gradient sums in registers. Triton blocks need powers of two. Off the GPU they run in
Pallas's interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

try:  # deprecated in jax 0.11 and to be removed
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:
    pallas_triton = None

# Rows per program in the forward, and per loop iteration in the backward (which also keeps the
# scale/bias gradient sums in registers across iterations, so the partial sums stay small).
FORWARD_ROWS = 8
FORWARD_WARPS = 4
BACKWARD_ROWS = 4
BACKWARD_PROGRAMS = 512
BACKWARD_WARPS = 4


def unsupported(features: int, rows: int, dtype) -> str | None:
    """Why these kernels can't take `rows` rows (per device) of `features`, or None."""
    if pallas_triton is None:
        return "this jax has no Pallas Triton backend"
    if not (_pow2(features) and _pow2(rows) and rows >= FORWARD_ROWS * BACKWARD_ROWS):
        return f"Triton blocks need powers of two: features {features}, rows per device {rows} (at least 32)"
    return None


def _normalize(total, rms: bool, eps: float):
    centered = total if rms else total - jnp.mean(total, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return centered * rstd, rstd


def _forward_kernel(*refs, rms, eps, has_delta, has_bias):
    refs = list(refs)
    x_ref = refs.pop(0)
    delta_ref = refs.pop(0) if has_delta else None
    scale_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    total_ref, normed_ref = refs if has_delta else (None, refs[0])
    total = x_ref[...]
    if has_delta:
        total = (total.astype(jnp.float32) + delta_ref[...].astype(jnp.float32)).astype(total_ref.dtype)
        total_ref[...] = total
    normed = _normalize(total.astype(jnp.float32), rms, eps)[0] * scale_ref[...].astype(jnp.float32)
    if has_bias:
        normed = normed + bias_ref[...].astype(jnp.float32)
    normed_ref[...] = normed.astype(normed_ref.dtype)


def _backward_kernel(*refs, rms, eps, has_residual_grad, has_bias, steps):
    refs = list(refs)
    total_ref, d_normed_ref = refs.pop(0), refs.pop(0)
    d_total_ref = refs.pop(0) if has_residual_grad else None
    scale_ref = refs.pop(0)
    d_sum_ref, d_scale_ref = refs.pop(0), refs.pop(0)
    d_bias_ref = refs.pop(0) if has_bias else None
    program = pl.program_id(0)
    scale = scale_ref[...].astype(jnp.float32)
    features = scale.shape[-1]

    def body(step, sums):
        rows = pl.ds((program * steps + step) * BACKWARD_ROWS, BACKWARD_ROWS)
        normalized, rstd = _normalize(total_ref[rows, :].astype(jnp.float32), rms, eps)
        d_normed = d_normed_ref[rows, :].astype(jnp.float32)
        grad = d_normed * scale
        # d/dx of the normalization: rstd * (g - mean(g) - xhat * mean(g * xhat)), without the
        # mean(g) term for RMSNorm (xhat: the normalized row, g: the gradient times the scale).
        d_x = grad - normalized * jnp.mean(grad * normalized, axis=-1, keepdims=True)
        if not rms:
            d_x = d_x - jnp.mean(grad, axis=-1, keepdims=True)
        d_x = d_x * rstd
        if has_residual_grad:
            d_x = d_x + d_total_ref[rows, :].astype(jnp.float32)
        d_sum_ref[rows, :] = d_x.astype(d_sum_ref.dtype)
        d_scale_sum, d_bias_sum = sums
        return d_scale_sum + jnp.sum(d_normed * normalized, axis=0), d_bias_sum + jnp.sum(d_normed, axis=0)

    zeros = jnp.zeros((features,), jnp.float32)
    d_scale_sum, d_bias_sum = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    d_scale_ref[pl.ds(program, 1), :] = d_scale_sum[None, :]
    if has_bias:
        d_bias_ref[pl.ds(program, 1), :] = d_bias_sum[None, :]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def forward_local(rms, eps, x, delta, scale, bias):
    shape, features = x.shape, x.shape[-1]
    rows = int(np.prod(shape[:-1]))
    has_delta, has_bias = delta is not None, bias is not None
    operands = [x.reshape(rows, features)]
    if has_delta:
        operands.append(delta.reshape(rows, features))
    operands.append(scale)
    if has_bias:
        operands.append(bias)
    row_block = pl.BlockSpec((FORWARD_ROWS, features), lambda i: (i, 0))
    vector = pl.BlockSpec((features,), lambda i: (0,))
    in_specs = [row_block] * (2 if has_delta else 1) + [vector] * (2 if has_bias else 1)
    outputs = [jax.ShapeDtypeStruct((rows, features), x.dtype)] * (2 if has_delta else 1)
    results = pl.pallas_call(
        functools.partial(_forward_kernel, rms=rms, eps=eps, has_delta=has_delta, has_bias=has_bias),
        out_shape=outputs,
        grid=(rows // FORWARD_ROWS,),
        in_specs=in_specs,
        out_specs=[row_block] * len(outputs),
        compiler_params=pallas_triton.CompilerParams(num_warps=FORWARD_WARPS, num_stages=1),
        interpret=_interpret(),
        name="add_norm_forward",
    )(*operands)
    total, normed = results if has_delta else (x.reshape(rows, features), results[0])
    return total.reshape(shape), normed.reshape(shape)


def backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    shape, features = total.shape, total.shape[-1]
    rows = int(np.prod(shape[:-1]))
    programs = min(BACKWARD_PROGRAMS, rows // BACKWARD_ROWS)
    steps = rows // (BACKWARD_ROWS * programs)
    operands = [total.reshape(rows, features), d_normed.reshape(rows, features)]
    if d_total is not None:
        operands.append(d_total.reshape(rows, features))
    operands.append(scale)
    partial = jax.ShapeDtypeStruct((programs, features), jnp.float32)
    outputs = [jax.ShapeDtypeStruct((rows, features), total.dtype), partial] + ([partial] if has_bias else [])
    results = pl.pallas_call(
        functools.partial(_backward_kernel, rms=rms, eps=eps, has_residual_grad=d_total is not None,
                          has_bias=has_bias, steps=steps),
        out_shape=outputs,
        grid=(programs,),
        compiler_params=pallas_triton.CompilerParams(num_warps=BACKWARD_WARPS, num_stages=1),
        interpret=_interpret(),
        name="add_norm_backward",
    )(*operands)
    d_sum = results[0].reshape(shape)
    return (d_sum, *results[1:]) if has_bias else (d_sum, results[1], None)
