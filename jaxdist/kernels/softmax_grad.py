"""Cross-entropy's per-row loss and logits gradient in one GPU kernel (Pallas, Mosaic GPU).

The chunked loss (models/cross_entropy.py) needs, for each row of a chunk's logits, the
logsumexp, the target's logit and the gradient `(softmax - one-hot) * weight`. XLA makes that
two passes over the logits: a reduction (at a fraction of the memory bandwidth), then an
elementwise pass that reads the logits again and writes the gradient. Here each program takes 4
rows (one per warp, kernels/mosaic.py) and walks them twice: first an online maximum and sum of
exponentials over blocks of the vocabulary, then the gradient, reading the blocks again soon
after, when L2 may still hold them (times: docs/performance.md, benchmarks/bench_softmax_grad.py).
The target's logit is one gather outside the kernel.

Off the GPU the kernel runs in Mosaic GPU's interpreter, so the CPU tests check the same code.
Under a mesh it runs per shard of the rows; the vocabulary must be whole on each device
(`unsupported`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jaxdist.kernels import mosaic, switch
from jaxdist.parallel import rules as rules_lib

LOGITS: tuple[str, ...] = ("batch", "length", "vocab")
# Columns per block (narrowed to the vocabulary's): the fastest of 1024, 2048 and 4096 on one H100
# (benchmarks/bench_softmax_grad.py).
BLOCK = 1024


def unsupported(shape: tuple[int, int, int], dtype) -> str | None:
    """Why the kernel can't take (batch, length, vocab) logits of `dtype` under the active rules,
    or None where it can: the vocabulary whole on each device and at least 32 wide, rows per device
    a multiple of 4, Mosaic GPU in this jax and GPU."""
    reason = mosaic.unavailable()
    if reason is not None:
        return reason
    rows = shape[0] * shape[1]
    sharded = rules_lib.sharded_activation(LOGITS)
    if sharded is not None:
        mesh, spec = sharded
        if spec[-1] is not None:
            return "it needs the vocabulary whole on each device; the rules split it"
        rows //= math.prod(rules_lib.axes_size(mesh, rules_lib.spec_axes(entry)) for entry in spec[:2])
    if shape[2] < mosaic.LANES:
        return f"the vocabulary ({shape[2]}) must be at least {mosaic.LANES} wide"
    if rows % mosaic.ROWS:
        return f"rows per device ({rows}) must be a multiple of {mosaic.ROWS}"
    return None


def use_kernel(impl: str, shape: tuple[int, int, int], dtype) -> bool:
    """Whether `model.impl.loss_impl` = `impl` runs the kernel on a chunk's (batch, length, vocab) logits
    (kernels/switch.py)."""
    return switch.wanted(impl) and switch.decide(
        "loss_impl", impl, unsupported(shape, dtype), "the loss's softmax runs as XLA's two passes")


def loss_and_grad(logits: jax.Array, targets: jax.Array, weights: jax.Array, *,
                  grad_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(per-row loss `logsumexp - target logit`, float32, (batch, length); the logits' gradient).

    logits: (batch, length, vocab) in any float dtype, read as float32; targets: (batch, length)
    integers; weights: (batch,) float32, each sequence's weight. The gradient
    `(softmax(logits) - one_hot(targets)) * weights` has the logits' shape and `grad_dtype`
    (default: the logits' dtype).
    """
    local = functools.partial(_local, grad_dtype=jnp.dtype(grad_dtype or logits.dtype))
    sharded = rules_lib.sharded_activation(LOGITS)
    if sharded is None:
        return local(logits, targets, weights)
    mesh, spec = sharded
    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec, PartitionSpec(*spec[:2]), PartitionSpec(spec[0])),
        out_specs=(PartitionSpec(*spec[:2]), spec), check_vma=False,
    )(logits, targets, weights)


def _vector(vocab: int, dtype) -> int:
    """Values per lane and run: at most 16 bytes, dividing the vocabulary, so that every block's
    start (the last one's too) stays aligned, and one run of the warp's lanes within it."""
    return next(v for v in (8, 4, 2, 1)
                if v * jnp.dtype(dtype).itemsize <= 16 and vocab % v == 0 and vocab >= mosaic.LANES * v)


def _local(logits, targets, weights, *, grad_dtype, block: int = BLOCK):
    """The kernel on one device's (batch, length, vocab) logits."""
    batch, length, vocab = logits.shape
    rows = batch * length
    vector = _vector(vocab, logits.dtype)
    run = mosaic.LANES * vector
    block = max(run, min(block, vocab) // run * run)  # whole runs, within the vocabulary
    layout = mosaic.block_layout(vector)
    blocks = pl.cdiv(vocab, block)
    size = (mosaic.ROWS, block)

    def softmax_grad(logits_ref, targets_ref, weights_ref, logsumexp_ref, grad_ref):
        rows = mosaic.block_rows(mosaic.program())
        column = mosaic.relayout(jax.lax.broadcasted_iota(jnp.int32, size, 1), layout)

        def start(k):
            # The last block ends at the vocabulary's end (overlapping the one before it) rather
            # than past it, so every load stays in bounds.
            return jnp.minimum(k * block, vocab - block)

        def first_pass(k, carry):
            maximum, total = carry
            x = mosaic.load(logits_ref.at[rows, pl.ds(start(k), block)], layout).astype(jnp.float32)
            x = jnp.where(column >= k * block - start(k), x, -jnp.inf)  # columns not visited yet
            new_max = jnp.maximum(maximum, jnp.max(x, axis=1))
            exp = jnp.exp(x - mosaic.per_row(new_max, size, layout))
            return new_max, total * jnp.exp(maximum - new_max) + jnp.sum(exp, axis=1)

        # The running maximum starts at float32's lowest finite value, not -inf: exp(lowest - x) is
        # 0, where exp(-inf - -inf) would be nan.
        per_row = layout.reduce(1)
        lowest = mosaic.relayout(jnp.full((mosaic.ROWS,), jnp.finfo(jnp.float32).min, jnp.float32), per_row)
        zeros = mosaic.relayout(jnp.zeros((mosaic.ROWS,), jnp.float32), per_row)
        maximum, total = jax.lax.fori_loop(0, blocks, first_pass, (lowest, zeros))
        logsumexp = maximum + jnp.log(total)
        logsumexp_ref[rows] = logsumexp
        logsumexp = mosaic.per_row(logsumexp, size, layout)
        target = mosaic.load(targets_ref.at[rows], per_row)
        weight = mosaic.per_row(mosaic.load(weights_ref.at[rows], per_row), size, layout)

        def second_pass(k, _):
            # The overlapping columns of the last block are written twice with the same values.
            cols = pl.ds(start(k), block)
            x = mosaic.load(logits_ref.at[rows, cols], layout).astype(jnp.float32)
            is_target = column == mosaic.per_row(target - start(k), size, layout)
            grad = (jnp.exp(x - logsumexp) - jnp.where(is_target, 1.0, 0.0)) * weight
            grad_ref[rows, cols] = grad.astype(grad_dtype)
            return 0

        jax.lax.fori_loop(0, blocks, second_pass, 0)

    row_weights = jnp.broadcast_to(weights.astype(jnp.float32)[:, None], (batch, length)).reshape(rows)
    out_type = (jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows, vocab), grad_dtype))
    flat_logits, flat_targets = logits.reshape(rows, vocab), targets.reshape(rows).astype(jnp.int32)
    logsumexp, grad = mosaic.kernel(softmax_grad, out_type, rows // mosaic.ROWS, "softmax_grad")(
        flat_logits, flat_targets, row_weights)
    target_logit = jnp.take_along_axis(flat_logits, flat_targets[:, None], axis=1)[:, 0].astype(jnp.float32)
    return (logsumexp - target_logit).reshape(batch, length), grad.reshape(logits.shape)
