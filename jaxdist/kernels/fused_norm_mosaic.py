"""The fused norms' kernels on Pallas's Mosaic GPU backend (Hopper and later).

Each program walks a contiguous share of the rows in blocks (kernels/mosaic.py says how a program
holds them: a row per warp): the inputs are copied into shared memory a few blocks ahead (TMA), the
outputs stored from registers. A row is worked on in chunks of up to `CHUNK` columns, each copied
to a buffer of its own: with one chunk the row stays in registers from its statistics to its
outputs; with more, each pass over the row (its mean, its variance, its outputs) reads the chunks
again from shared memory, so no lane holds more than a chunk's values of any row-sized array. The
backward adds each lane's scale and bias gradient terms to running sums (in registers with one
chunk, in shared memory with more) and writes them once per program. Features any multiple of 32
up to `CHUNK`, or of `CHUNK` above it; rows a multiple of 4. Off the GPU the kernels run in Mosaic
GPU's interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxdist.kernels import mosaic

# Blocks in flight per program (copies issued ahead of the block being computed) and programs per
# multiprocessor, where shared memory allows: the fastest of those timed on one H100
# (benchmarks/reports/2026-11-27-pallas-on-mosaic-gpu.md; benchmarks/bench_fused_norm.py --sweep times them).
FORWARD_STAGES = 2
FORWARD_PROGRAMS_PER_SM = 3
BACKWARD_STAGES = 3
BACKWARD_PROGRAMS_PER_SM = 2
# Columns of a row a lane works on at once: 32 values per lane of each row-sized array. A whole row
# of 2048 features per warp (64 values each) spilled registers in the backward and ran slower than
# XLA's fusions (benchmarks/reports/2026-11-27-pallas-on-mosaic-gpu.md).
CHUNK = 1024
SHARED_MEMORY = 227 * 1024  # bytes of shared memory one multiprocessor gives its programs (Hopper)


def unsupported(features: int, rows: int, dtype) -> str | None:
    """Why these kernels can't take `rows` rows (per device) of `features`, or None."""
    reason = mosaic.unavailable()
    if reason is not None:
        return reason
    if mosaic.vector(features, jnp.dtype(dtype).itemsize) is None:
        return f"features ({features}) must be a multiple of 32"
    if features > CHUNK and features % CHUNK:
        return f"features ({features}) above {CHUNK} must be a multiple of {CHUNK}"
    if rows % mosaic.ROWS:
        return f"rows per device ({rows}) must be a multiple of {mosaic.ROWS}"
    if _shared_bytes(features, jnp.dtype(dtype).itemsize, streamed=3, stages=1, sums=2) > SHARED_MEMORY:
        return f"features ({features}) too many for a block of rows in shared memory"
    return None


def row_chunks(features: int) -> int:
    """How many chunks these kernels take a row of `features` in."""
    return max(1, features // CHUNK)


def _shared_bytes(features: int, itemsize: int, streamed: int, stages: int, sums: int) -> int:
    """Shared memory one program uses: its streamed blocks, and its running sums with more than one chunk."""
    held_sums = sums * mosaic.ROWS * features * 4 if row_chunks(features) > 1 else 0
    return streamed * stages * mosaic.ROWS * features * itemsize + held_sums


def _fit(features: int, itemsize: int, streamed: int, stages: int, per_sm: int, sums: int = 0) -> tuple[int, int]:
    """(stages, programs per multiprocessor): as asked, fewer where shared memory would overflow."""
    while stages > 1 and _shared_bytes(features, itemsize, streamed, stages, sums) > SHARED_MEMORY:
        stages -= 1
    return stages, max(1, min(per_sm, SHARED_MEMORY // _shared_bytes(features, itemsize, streamed, stages, sums)))


def _keep(chunks: int):
    """Decorates a function of a chunk index: with one chunk its results are kept (in registers
    from the row's statistics to its outputs); with more, each call recomputes them from shared
    memory, so no lane holds more than a chunk of any row-sized array."""
    return functools.cache if chunks == 1 else (lambda fn: fn)


def _vectors(refs, chunks: int, chunk: int, layout):
    """`get(c)`: chunk `c` of each (features,) vector in `refs`, float32 in `layout.reduce(0)`: loaded
    once with one chunk; with more at each use (from global memory, where they stay cached)."""
    @_keep(chunks)
    def get(c):
        return [mosaic.load(ref.at[pl.ds(c * chunk, chunk)] if chunks > 1 else ref, layout.reduce(0)).astype(jnp.float32)
                for ref in refs]

    return get


def _shared_chunks(blocks, chunks: int, layout):
    """`get(c)`: chunk `c` of each streamed input's shared block (`stream`'s flat list, input by
    input), float32 in `layout`."""
    @_keep(chunks)
    def get(c):
        return [mosaic.load_shared(blocks[i + c], layout).astype(jnp.float32) for i in range(0, len(blocks), chunks)]

    return get


def _write_sums(sum_refs, final, held_refs, chunks: int, chunk: int, layout):
    """Writes a program's running sums (the scale's gradient terms, and the bias's) to its rows of
    `sum_refs`, once: from the registers (`final`, what the stream carried) with one chunk, else
    from the shared buffers (`held_refs`, a buffer per sum and chunk)."""
    sums = len(sum_refs)
    program_rows = mosaic.block_rows(mosaic.program())
    for s, ref in enumerate(sum_refs):
        for c in range(chunks):
            value = final[s] if chunks == 1 else mosaic.load(held_refs[c * sums + s], layout)
            ref[program_rows, pl.ds(c * chunk, chunk)] = value

def forward_local(rms, eps, x, delta, scale, bias):
    shape, features = x.shape, x.shape[-1]
    rows, dtype = x.size // features, x.dtype
    has_delta = delta is not None
    chunks = row_chunks(features)
    chunk = features // chunks
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    streamed = [mosaic.runs(a.reshape(rows, features)) for a in (x, delta) if a is not None]
    vectors = [v for v in (scale, bias) if v is not None]
    stages, per_sm = _fit(features, dtype.itemsize, len(streamed), FORWARD_STAGES, FORWARD_PROGRAMS_PER_SM)
    programs = min(rows // mosaic.ROWS, mosaic.programs_per_device(per_sm))

    def add_norm_forward(*refs):
        streamed_refs, vector_refs, out_refs = refs[:len(streamed)], refs[len(streamed):-len(streamed)], refs[-len(streamed):]
        column_vectors = _vectors(vector_refs, chunks, chunk, layout)
        keep, size = _keep(chunks), (mosaic.ROWS, chunk)

        def step(block, *blocks):
            inputs = _shared_chunks(blocks, chunks, layout)

            @keep
            def total(c):  # the sum rounded to the inputs' dtype, as the unfused `x + delta` is
                values = inputs(c)
                return (values[0] + values[1]).astype(dtype).astype(jnp.float32) if has_delta else values[0]

            mean = 0.0 if rms else sum(jnp.sum(total(c), axis=1) for c in range(chunks)) / features

            @keep
            def centered(c):
                return total(c) if rms else total(c) - mosaic.per_row(mean, size, layout)

            rstd = jax.lax.rsqrt(sum(jnp.sum(centered(c) * centered(c), axis=1) for c in range(chunks)) / features + eps)
            rows = mosaic.block_rows(block)
            for c in range(chunks):
                scale, *bias = column_vectors(c)
                normed = centered(c) * mosaic.per_row(rstd, size, layout) * mosaic.per_column(scale, size, layout)
                if bias:
                    normed = normed + mosaic.per_column(bias[0], size, layout)
                columns = pl.ds(c * chunk, chunk)
                out_refs[0][rows, columns] = normed.astype(dtype)
                if has_delta:
                    out_refs[1][rows, columns] = total(c).astype(dtype)
            mosaic.end_step()

        mosaic.stream(step, streamed_refs, programs, stages, chunks=chunks)

    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] * len(streamed)
    normed, *total = mosaic.kernel(add_norm_forward, out_type, programs, "add_norm_forward")(*streamed, *vectors)
    total = total[0] if has_delta else x
    return total.reshape(shape), normed.reshape(shape)


def backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    shape, features = total.shape, total.shape[-1]
    rows, dtype = total.size // features, total.dtype
    has_residual_grad = d_total is not None
    chunks = row_chunks(features)
    chunk = features // chunks
    layout = mosaic.block_layout(mosaic.vector(features, dtype.itemsize))
    streamed = [mosaic.runs(a.reshape(rows, features)) for a in (total, d_normed, d_total) if a is not None]
    sums = 2 if has_bias else 1
    stages, per_sm = _fit(features, dtype.itemsize, len(streamed), BACKWARD_STAGES, BACKWARD_PROGRAMS_PER_SM, sums)
    programs = min(rows // mosaic.ROWS, mosaic.programs_per_device(per_sm))
    # With more than one chunk the running sums live in shared memory, a buffer per sum and chunk.
    held = [jax.ShapeDtypeStruct((mosaic.ROWS, chunk), jnp.float32)] * (sums * chunks if chunks > 1 else 0)

    def add_norm_backward(*refs):
        streamed_refs, scale_ref = refs[:len(streamed)], refs[len(streamed)]
        d_sum_ref, *sum_refs = refs[len(streamed) + 1:len(streamed) + 2 + sums]
        held_refs = refs[len(streamed) + 2 + sums:]
        column_scale = _vectors([scale_ref], chunks, chunk, layout)
        keep, size = _keep(chunks), (mosaic.ROWS, chunk)
        zeros = mosaic.relayout(jnp.zeros(size, jnp.float32), layout)
        for ref in held_refs:
            ref[...] = zeros

        def step(block, *blocks_and_sums):
            blocks = blocks_and_sums[:len(streamed) * chunks]
            carried = blocks_and_sums[-1] if chunks == 1 else ()  # the running sums, in registers
            inputs = _shared_chunks(blocks, chunks, layout)
            mean = 0.0 if rms else sum(jnp.sum(inputs(c)[0], axis=1) for c in range(chunks)) / features

            @keep
            def centered_and_grad(c):  # the centered row, and the normed output's gradient times the scale
                values = inputs(c)
                centered = values[0] if rms else values[0] - mosaic.per_row(mean, size, layout)
                return centered, values[1] * mosaic.per_column(column_scale(c)[0], size, layout)

            squares = g_centered = g_sum = 0.0
            for c in range(chunks):  # the row sums, in one pass
                centered, grad = centered_and_grad(c)
                squares = squares + jnp.sum(centered * centered, axis=1)
                g_centered = g_centered + jnp.sum(grad * centered, axis=1)
                if not rms:
                    g_sum = g_sum + jnp.sum(grad, axis=1)
            rstd = jax.lax.rsqrt(squares / features + eps)
            # d/dx of the normalization: rstd * (g - mean(g) - xhat * mean(g * xhat)), without the
            # mean(g) term for RMSNorm (xhat: the normalized row, g: the gradient times the scale);
            # mean(g * xhat) = rstd * mean(g * centered).
            g_xhat = rstd * g_centered / features
            rows, running = mosaic.block_rows(block), []
            for c in range(chunks):
                (centered, grad), values = centered_and_grad(c), inputs(c)
                normalized = centered * mosaic.per_row(rstd, size, layout)
                d_x = grad - normalized * mosaic.per_row(g_xhat, size, layout)
                if not rms:
                    d_x = d_x - mosaic.per_row(g_sum / features, size, layout)
                d_x = d_x * mosaic.per_row(rstd, size, layout)
                if has_residual_grad:
                    d_x = d_x + values[2]
                d_sum_ref[rows, pl.ds(c * chunk, chunk)] = d_x.astype(dtype)
                terms = (values[1] * normalized, values[1])[:sums]
                if chunks == 1:
                    running = [total + term for total, term in zip(carried, terms)]
                else:
                    for ref, term in zip(held_refs[c * sums:(c + 1) * sums], terms):
                        ref[...] = mosaic.load(ref, layout) + term
            mosaic.end_step()
            return tuple(running) if chunks == 1 else None

        # Each lane keeps its columns' running sums over its rows; the program writes them out once.
        carry = (zeros,) * sums if chunks == 1 else None
        final = mosaic.stream(step, streamed_refs, programs, stages, carry=carry, chunks=chunks)
        _write_sums(sum_refs, final, held_refs, chunks, chunk, layout)

    partial = jax.ShapeDtypeStruct((programs * mosaic.ROWS, features), jnp.float32)
    out_type = [jax.ShapeDtypeStruct((rows, features), dtype)] + [partial] * sums
    d_sum, d_scale, *d_bias = mosaic.kernel(add_norm_backward, out_type, programs, "add_norm_backward", held)(
        *streamed, scale)
    return d_sum.reshape(shape), d_scale, d_bias[0] if has_bias else None

