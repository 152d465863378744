"""Residual add + LayerNorm/RMSNorm as one GPU kernel forward and one backward (Pallas).

A pre-norm block computes `x = x + delta` and then `norm(x)`. XLA splits that, and its backward,
into several fusions with a float32 intermediate: on the 406M GPT (one H100) the norms and residual
adds took about 470 us per layer, against about 180 us to move their bytes once. Here:

- forward: reads `x` and `delta` once; writes the sum (the next residual) and the normed output;
- backward: reads the sum, the gradient of the normed output and the gradient that reaches the sum
  along the residual path; recomputes the row statistics; writes the sum's gradient and per-program
  partial sums of the scale and bias gradients (summed outside, where XLA reduces across devices).

The kernels use Pallas's Triton backend, which OpenXLA's own kernel library (tokamax) also uses for
its norms. Off the GPU they run in Pallas's interpreter, so the CPU tests check the same code.
Under a mesh the kernels run per shard (`shard_map` over the rows' mesh axes); the embedding axis
must be whole on each device. `supported` says when this path applies; the model falls back to
plain XLA otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jaxdist.parallel import rules as rules_lib

try:  # deprecated in jax 0.11 and to be removed: without it, the model keeps XLA's norms
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


def supported(shape: tuple[int, ...], names) -> bool:
    """Whether the kernels take an activation of this (..., features) shape and logical names.

    Triton blocks need powers of two (features, and rows per shard); the feature axis must be whole
    on each device; the installed jax must still have Pallas's Triton backend.
    """
    if pallas_triton is None:
        return False
    sharded = rules_lib.sharded_activation(tuple(names))
    shards = 1
    if sharded is not None:
        mesh, spec = sharded
        if spec[-1] is not None:
            return False
        shards = rules_lib.axes_size(mesh, _row_axes(spec))
    rows = int(np.prod(shape[:-1])) // shards
    return _pow2(shape[-1]) and _pow2(rows) and rows >= FORWARD_ROWS * BACKWARD_ROWS


def add_norm(x, delta, scale, bias, *, rms: bool, eps: float, names):
    """`(x + delta, norm(x + delta))`: the next residual and its normed rows.

    `x` and `delta` are (..., features) in the compute dtype; `scale` and `bias` (None for RMSNorm)
    are (features,). The norm is computed in float32 from the sum rounded to `x.dtype`, as the
    unfused `x + delta` then `norm` does. `names` are the activation's logical axis names.
    """
    return _add_norm(rms, eps, _shards(names), x, delta, scale, bias)


def norm(x, scale, bias, *, rms: bool, eps: float, names):
    """`norm(x)` with the same kernels (no residual add)."""
    return _norm(rms, eps, _shards(names), x, scale, bias)


def _shards(names) -> tuple | None:
    """(mesh, spec) of the activation under the rules of the forward pass, which its backward, traced
    later (maybe outside those rules, as a pipeline's), runs under too; None without a mesh."""
    return rules_lib.sharded_activation(tuple(names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _add_norm(rms, eps, shards, x, delta, scale, bias):
    return _forward(rms, eps, shards, x, delta, scale, bias)


def _add_norm_fwd(rms, eps, shards, x, delta, scale, bias):
    total, normed = _forward(rms, eps, shards, x, delta, scale, bias)
    return (total, normed), (total, scale, bias)


def _add_norm_bwd(rms, eps, shards, residuals, cotangents):
    total, scale, bias = residuals
    d_total, d_normed = cotangents
    d_sum, d_scale, d_bias = _backward(rms, eps, shards, total, d_normed, d_total, scale, bias is not None)
    return d_sum, d_sum, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm(rms, eps, shards, x, scale, bias):
    return _forward(rms, eps, shards, x, None, scale, bias)[1]


def _norm_fwd(rms, eps, shards, x, scale, bias):
    return _norm(rms, eps, shards, x, scale, bias), (x, scale, bias)


def _norm_bwd(rms, eps, shards, residuals, d_normed):
    x, scale, bias = residuals
    d_x, d_scale, d_bias = _backward(rms, eps, shards, x, d_normed, None, scale, bias is not None)
    return d_x, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


# -- the kernels -------------------------------------------------------------------------------------


def normalize(total, rms: bool, eps: float):
    """(..., features) float32 -> (normalized rows before scale and bias, 1 / row std).

    The norm's math, shared by the kernels and the model's plain XLA path.
    """
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
    normed = normalize(total.astype(jnp.float32), rms, eps)[0] * scale_ref[...].astype(jnp.float32)
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
        normalized, rstd = normalize(total_ref[rows, :].astype(jnp.float32), rms, eps)
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


def _forward_local(rms, eps, x, delta, scale, bias):
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


def _backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
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


# -- running per shard under a mesh -----------------------------------------------------------------


def _row_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes that split the rows: those of every entry but the feature axis."""
    return tuple(axis for entry in tuple(spec)[:-1] for axis in rules_lib.spec_axes(entry))


def _run_per_shard(shards, local, arrays: dict, row_wise: set[str], out_specs):
    """`local(**arrays)` on each shard of the rows of the (mesh, spec) `shards` (or once, with None);
    None entries stay out."""
    present = {name: value for name, value in arrays.items() if value is not None}

    def run(present):
        return local(**{**dict.fromkeys(arrays), **present})

    if shards is None:
        return run(present)
    mesh, spec = shards
    in_specs = {name: spec if name in row_wise else PartitionSpec() for name in present}
    partials = PartitionSpec(_row_axes(spec) or None, None)
    out_specs = tuple(spec if kind == "rows" else partials if kind == "partials" else None for kind in out_specs)
    return jax.shard_map(run, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False)(present)


def _forward(rms, eps, shards, x, delta, scale, bias):
    arrays = dict(x=x, delta=delta, scale=scale, bias=bias)
    local = functools.partial(_forward_local, rms, eps)
    return _run_per_shard(shards, local, arrays, {"x", "delta"}, ("rows", "rows"))


def _backward(rms, eps, shards, total, d_normed, d_total, scale, has_bias):
    arrays = dict(total=total, d_normed=d_normed, d_total=d_total, scale=scale)
    local = functools.partial(_backward_local, rms, eps, has_bias)
    outputs = ("rows", "partials", "partials" if has_bias else None)
    d_sum, d_scale, d_bias = _run_per_shard(shards, local, arrays, {"total", "d_normed", "d_total"}, outputs)
    return d_sum, d_scale.sum(0), None if d_bias is None else d_bias.sum(0)
