"""The fused norms' kernels on Pallas's Mosaic GPU backend (Hopper and later).

Each program walks a contiguous share of the rows in blocks (kernels/mosaic.py says how a program
holds them: a row per warp): the inputs are copied into shared memory a few blocks ahead (TMA), the
outputs stored from registers. The backward keeps each lane's running scale and bias gradient sums
in registers and writes them once per program. Features any multiple of 32, rows a multiple of 4.
Up to `MAX_FEATURES` features. Off the GPU the kernels run in Mosaic GPU's interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.kernels import mosaic

# Blocks in flight per program (copies issued ahead of the block being computed) and programs per
# multiprocessor: the fastest of those timed on one H100 (benchmarks/HISTORY.md, tenth set;
# benchmarks/bench_fused_norm.py --sweep times them).
FORWARD_STAGES = 2
FORWARD_PROGRAMS_PER_SM = 3
BACKWARD_STAGES = 3
BACKWARD_PROGRAMS_PER_SM = 2
# A row per warp puts features / 32 values of each row-sized array in each lane's registers: at
# 1024 features (32 each) the backward's arrays fit; at 2048 they spill, and the kernels ran slower
# than XLA's fusions (benchmarks/README.md). Wider rows go to the next implementation.
MAX_FEATURES = 1024


def unsupported(features: int, rows: int, dtype) -> str | None:
    """Why these kernels can't take `rows` rows (per device) of `features`, or None."""
    reason = mosaic.unavailable()
    if reason is not None:
        return reason
    if mosaic.vector(features, jnp.dtype(dtype).itemsize) is None:
        return f"features ({features}) must be a multiple of 32"
    if features > MAX_FEATURES:
        return f"features ({features}) above {MAX_FEATURES}: a row per warp would spill registers"
    if rows % mosaic.ROWS:
        return f"rows per device ({rows}) must be a multiple of {mosaic.ROWS}"
    return None


def _statistics(total, rms: bool, eps: float, layout):
    """`normalize` in a kernel: (rows, features) float32 in `layout` -> (centered rows, 1 / row std)."""
    shape, features = total.shape, total.shape[1]
    centered = total if rms else total - mosaic.per_row(jnp.sum(total, axis=1) / features, shape, layout)
    return centered, jax.lax.rsqrt(jnp.sum(centered * centered, axis=1) / features + eps)


def forward_local(rms, eps, x, delta, scale, bias):
    shape, features = x.shape, x.shape[-1]
    rows, dtype = x.size // features, x.dtype
    has_delta, has_bias = delta is not None, bias is not None
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    programs = min(rows // mosaic.ROWS, mosaic.programs_per_device(FORWARD_PROGRAMS_PER_SM))
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

        mosaic.stream(step, streamed_refs, programs, FORWARD_STAGES)

    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] * len(streamed)
    normed, *total = mosaic.kernel(add_norm_forward, out_type, programs, "add_norm_forward")(*streamed, *vectors)
    total = total[0] if has_delta else x
    return total.reshape(shape), normed.reshape(shape)


def backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    shape, features = total.shape, total.shape[-1]
    rows, dtype = total.size // features, total.dtype
    has_residual_grad = d_total is not None
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    programs = min(rows // mosaic.ROWS, mosaic.programs_per_device(BACKWARD_PROGRAMS_PER_SM))
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
        sums = mosaic.stream(step, streamed_refs, programs, BACKWARD_STAGES, carry=(zeros,) * len(sum_refs))
        for ref, value in zip(sum_refs, sums):
            ref[mosaic.block_rows(mosaic.program())] = value

    partial = jax.ShapeDtypeStruct((programs * mosaic.ROWS, features), jnp.float32)
    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] + [partial] * (2 if has_bias else 1)
    d_sum, d_scale, *d_bias = mosaic.kernel(add_norm_backward, out_type, programs, "add_norm_backward")(*streamed, scale)
    return d_sum.reshape(shape), d_scale, d_bias[0] if has_bias else None
