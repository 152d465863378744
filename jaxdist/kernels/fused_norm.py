"""Residual add + LayerNorm/RMSNorm as one GPU kernel forward and one backward (Pallas, Mosaic GPU).

A pre-norm block computes `x = x + delta` and then `norm(x)`. XLA splits that, and its backward,
into several fusions with a float32 intermediate: on the 406M GPT (one H100) the norms and residual
adds took about 470 us per layer, against about 180 us to move their bytes once. Here:

- forward: reads `x` and `delta` once; writes the sum (the next residual) and the normed output;
- backward: reads the sum, the gradient of the normed output and the gradient that reaches the sum
  along the residual path; recomputes the row statistics; writes the sum's gradient and per-program
  partial sums of the scale and bias gradients (summed outside, where XLA reduces across devices).

The kernels use Pallas's Mosaic GPU backend (Hopper and later; kernels/mosaic.py says how a program
holds its rows). Each program walks a contiguous share of the rows in blocks of 4, the inputs
copied into shared memory a few blocks ahead (TMA), the outputs stored from registers. Off the GPU
they run in Mosaic GPU's interpreter, so the CPU tests check the same code. Under a mesh the
kernels run per shard (`shard_map` over the rows' mesh axes); the embedding axis must be whole on
each device. `unsupported` says when this path doesn't apply; the model falls back to plain XLA.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.kernels import mosaic
from jaxdist.parallel import rules as rules_lib

# Blocks in flight per program (copies issued ahead of the block being computed) and programs per
# multiprocessor: the fastest of those timed on one H100 (benchmarks/bench_fused_norm.py --sweep).
FORWARD_STAGES = 2
FORWARD_PROGRAMS_PER_SM = 2
BACKWARD_STAGES = 2
BACKWARD_PROGRAMS_PER_SM = 2


def unsupported(shape: tuple[int, ...], dtype, names) -> str | None:
    """Why the kernels can't take an activation of this (..., features) shape, dtype and logical names
    here, or None where they can: the feature axis whole on each device and a multiple of 32 (16
    bytes per lane where it can), rows per device a multiple of 4, Mosaic GPU in this jax and GPU."""
    reason = mosaic.unavailable()
    if reason is not None:
        return reason
    sharded = rules_lib.sharded_activation(tuple(names))
    shards = 1
    if sharded is not None:
        mesh, spec = sharded
        if spec[-1] is not None:
            return "the rules split the feature axis over devices"
        shards = rules_lib.axes_size(mesh, _row_axes(spec))
    rows = int(np.prod(shape[:-1])) // shards
    if mosaic.vector(shape[-1], jnp.dtype(dtype).itemsize) is None:
        return f"features ({shape[-1]}) must be a multiple of 32"
    if rows % mosaic.ROWS:
        return f"rows per device ({rows}) must be a multiple of {mosaic.ROWS}"
    return None


def supported(shape: tuple[int, ...], names, dtype=jnp.bfloat16) -> bool:
    """Whether the kernels take an activation of this shape, logical names and dtype here."""
    return unsupported(shape, dtype, names) is None


def use_kernel(impl: str, x: jax.Array, names) -> bool:
    """Whether `impl.norm_impl` = `impl` runs the kernels on the activation `x` here.

    `auto` takes them on a GPU where they apply, warning once where they don't; `pallas` insists,
    raising with the reason.
    """
    if impl == "xla" or (impl == "auto" and jax.default_backend() != "gpu"):
        return False
    reason = unsupported(x.shape, x.dtype, names)
    if reason is None:
        return True
    if impl == "pallas":
        raise ValueError(f"impl.norm_impl=pallas: the fused norm can't run on activations of shape {x.shape} "
                         f"here: {reason}; use auto or xla")
    _warn_once(reason)
    return False


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"the residual adds and norms run as XLA's fusions (slower): {reason}", stacklevel=4)


def add_norm(x, delta, scale, bias, *, rms: bool, eps: float, names):
    """`(x + delta, norm(x + delta))`: the next residual and its normed rows.

    `x` and `delta` are (..., features) in the compute dtype; `scale` and `bias` (None for RMSNorm)
    are (features,). The norm is computed in float32 from the sum rounded to `x.dtype`, as the
    unfused `x + delta` then `norm` does. `names` are the activation's logical axis names.
    """
    return _add_norm(rms, eps, tuple(names), x, delta, scale, bias)


def norm(x, scale, bias, *, rms: bool, eps: float, names):
    """`norm(x)` with the same kernels (no residual add)."""
    return _norm(rms, eps, tuple(names), x, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _add_norm(rms, eps, names, x, delta, scale, bias):
    return _forward(rms, eps, names, x, delta, scale, bias)


def _add_norm_fwd(rms, eps, names, x, delta, scale, bias):
    total, normed = _forward(rms, eps, names, x, delta, scale, bias)
    return (total, normed), (total, scale, bias)


def _add_norm_bwd(rms, eps, names, residuals, cotangents):
    total, scale, bias = residuals
    d_total, d_normed = cotangents
    d_sum, d_scale, d_bias = _backward(rms, eps, names, total, d_normed, d_total, scale, bias is not None)
    return d_sum, d_sum, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm(rms, eps, names, x, scale, bias):
    return _forward(rms, eps, names, x, None, scale, bias)[1]


def _norm_fwd(rms, eps, names, x, scale, bias):
    return _norm(rms, eps, names, x, scale, bias), (x, scale, bias)


def _norm_bwd(rms, eps, names, residuals, d_normed):
    x, scale, bias = residuals
    d_x, d_scale, d_bias = _backward(rms, eps, names, x, d_normed, None, scale, bias is not None)
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


def _statistics(total, rms: bool, eps: float, layout):
    """`normalize` in a kernel: (rows, features) float32 in `layout` -> (centered rows, 1 / row std)."""
    shape, features = total.shape, total.shape[1]
    centered = total if rms else total - mosaic.per_row(jnp.sum(total, axis=1) / features, shape, layout)
    return centered, jax.lax.rsqrt(jnp.sum(centered * centered, axis=1) / features + eps)


def _forward_local(rms, eps, x, delta, scale, bias):
    shape, features = x.shape, x.shape[-1]
    rows, dtype = x.size // features, x.dtype
    has_delta, has_bias = delta is not None, bias is not None
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    blocks = rows // mosaic.ROWS
    programs = min(blocks, mosaic.programs_per_device(FORWARD_PROGRAMS_PER_SM))
    streamed = [mosaic.runs(a.reshape(rows, features)) for a in (x, delta) if a is not None]
    vectors = [v for v in (scale, bias) if v is not None]

    def add_norm_forward(*refs):
        streamed_refs, vector_refs, out_refs = refs[:len(streamed)], refs[len(streamed):-len(streamed)], refs[-len(streamed):]
        scale, *bias = [mosaic.load(ref, layout.reduce(0)).astype(jnp.float32) for ref in vector_refs]

        def step(block, x_block, *delta_block):
            total = mosaic.load_shared(x_block, layout)
            if has_delta:
                total = (total.astype(jnp.float32) + mosaic.load_shared(delta_block[0], layout).astype(jnp.float32))
                total = total.astype(dtype)
            centered, rstd = _statistics(total.astype(jnp.float32), rms, eps, layout)
            normed = centered * mosaic.per_row(rstd, centered.shape, layout) * mosaic.per_column(scale, centered.shape, layout)
            if has_bias:
                normed = normed + mosaic.per_column(bias[0], centered.shape, layout)
            rows = mosaic.block_rows(block)
            out_refs[0][rows] = normed.astype(dtype)
            if has_delta:
                out_refs[1][rows] = total
            mosaic.end_step()

        mosaic.stream(step, streamed_refs, blocks, programs, FORWARD_STAGES)

    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] * len(streamed)
    normed, *total = mosaic.kernel(add_norm_forward, out_type, programs, "add_norm_forward")(*streamed, *vectors)
    total = total[0] if has_delta else x
    return total.reshape(shape), normed.reshape(shape)


def _backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    shape, features = total.shape, total.shape[-1]
    rows, dtype = total.size // features, total.dtype
    has_residual_grad = d_total is not None
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    blocks = rows // mosaic.ROWS
    programs = min(blocks, mosaic.programs_per_device(BACKWARD_PROGRAMS_PER_SM))
    streamed = [mosaic.runs(a.reshape(rows, features)) for a in (total, d_normed, d_total) if a is not None]

    def add_norm_backward(*refs):
        outputs = 3 if has_bias else 2
        streamed_refs, scale_ref, (d_sum_ref, *sum_refs) = refs[:-outputs - 1], refs[-outputs - 1], refs[-outputs:]
        scale = mosaic.load(scale_ref, layout.reduce(0)).astype(jnp.float32)

        def step(block, total_block, d_normed_block, *rest):
            *d_total_block, sums = rest
            centered, rstd = _statistics(mosaic.load_shared(total_block, layout).astype(jnp.float32), rms, eps, layout)
            size = centered.shape
            rstd = mosaic.per_row(rstd, size, layout)
            normalized = centered * rstd
            d_normed = mosaic.load_shared(d_normed_block, layout).astype(jnp.float32)
            grad = d_normed * mosaic.per_column(scale, size, layout)
            # d/dx of the normalization: rstd * (g - mean(g) - xhat * mean(g * xhat)), without the
            # mean(g) term for RMSNorm (xhat: the normalized row, g: the gradient times the scale).
            d_x = grad - normalized * mosaic.per_row(jnp.sum(grad * normalized, axis=1) / features, size, layout)
            if not rms:
                d_x = d_x - mosaic.per_row(jnp.sum(grad, axis=1) / features, size, layout)
            d_x = d_x * rstd
            if has_residual_grad:
                d_x = d_x + mosaic.load_shared(d_total_block[0], layout).astype(jnp.float32)
            d_sum_ref[mosaic.block_rows(block)] = d_x.astype(dtype)
            mosaic.end_step()
            return tuple(total + term for total, term in zip(sums, (d_normed * normalized, d_normed)))

        # Each lane keeps its columns' running sums over its rows; the program writes them out once.
        zeros = mosaic.relayout(jnp.zeros((mosaic.ROWS, features), jnp.float32), layout)
        sums = mosaic.stream(step, streamed_refs, blocks, programs, BACKWARD_STAGES, carry=(zeros,) * len(sum_refs))
        for ref, value in zip(sum_refs, sums):
            ref[mosaic.block_rows(mosaic.program())] = value

    partial = jax.ShapeDtypeStruct((programs * mosaic.ROWS, features), jnp.float32)
    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] + [partial] * (2 if has_bias else 1)
    d_sum, d_scale, *d_bias = mosaic.kernel(add_norm_backward, out_type, programs, "add_norm_backward")(*streamed, scale)
    return d_sum.reshape(shape), d_scale, d_bias[0] if has_bias else None


# -- running per shard under a mesh -----------------------------------------------------------------


def _row_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes that split the rows: those of every entry but the feature axis."""
    return tuple(axis for entry in tuple(spec)[:-1] for axis in rules_lib.spec_axes(entry))


def _run_per_shard(names, local, arrays: dict, row_wise: set[str], out_specs):
    """`local(**arrays)` on each shard of the rows (or once, with no mesh); None entries stay out."""
    present = {name: value for name, value in arrays.items() if value is not None}

    def run(present):
        return local(**{**dict.fromkeys(arrays), **present})

    sharded = rules_lib.sharded_activation(names)
    if sharded is None:
        return run(present)
    mesh, spec = sharded
    in_specs = {name: spec if name in row_wise else PartitionSpec() for name in present}
    partials = PartitionSpec(_row_axes(spec) or None, None)
    out_specs = tuple(spec if kind == "rows" else partials if kind == "partials" else None for kind in out_specs)
    return jax.shard_map(run, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False)(present)


def _forward(rms, eps, names, x, delta, scale, bias):
    arrays = dict(x=x, delta=delta, scale=scale, bias=bias)
    local = functools.partial(_forward_local, rms, eps)
    return _run_per_shard(names, local, arrays, {"x", "delta"}, ("rows", "rows"))


def _backward(rms, eps, names, total, d_normed, d_total, scale, has_bias):
    arrays = dict(total=total, d_normed=d_normed, d_total=d_total, scale=scale)
    local = functools.partial(_backward_local, rms, eps, has_bias)
    outputs = ("rows", "partials", "partials" if has_bias else None)
    d_sum, d_scale, d_bias = _run_per_shard(names, local, arrays, {"total", "d_normed", "d_total"}, outputs)
    return d_sum, d_scale.sum(0), None if d_bias is None else d_bias.sum(0)
