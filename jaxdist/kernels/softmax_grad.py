"""Cross-entropy's per-row loss and logits gradient in one GPU kernel (Pallas).

The chunked loss (models/cross_entropy.py) needs, for each row of a chunk's logits, the
logsumexp, the target's logit and the gradient `(softmax - one-hot) * weight`. XLA makes that
two passes over the logits: a reduction (at a fraction of the memory bandwidth), then an
elementwise pass that reads the logits again and writes the gradient. Here one program per row
walks it twice: first an online max / sum of exponentials / target logit over blocks of the
vocabulary, then the gradient, reading the blocks again soon after, when L2 may still hold them
(times: docs/performance.md, benchmarks/bench_softmax_grad.py).

The kernel uses Pallas's Triton backend, as the fused norms do (kernels/fused_norm.py); off the GPU
it runs in Pallas's interpreter, so the CPU tests check the same code. Under a mesh it runs per
shard of the rows; the vocabulary must be whole on each device (`supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jaxdist.parallel import rules as rules_lib

try:  # deprecated in jax 0.11 and to be removed: without it, the loss keeps XLA's passes
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:
    pallas_triton = None

LOGITS: tuple[str, ...] = ("batch", "length", "vocab")
# Columns per block (a power of two, as Triton's blocks are; narrowed to the vocabulary's) and warps
# per program, one program per row: the fastest of those timed on one H200 (benchmarks/bench_softmax_grad.py).
# Programs that walk several rows each, or hold a whole row in registers, ran slower.
BLOCK = 4096
WARPS = 4


def supported() -> bool:
    """Whether the kernel applies under the active rules: the vocabulary whole on each device."""
    if pallas_triton is None:
        return False
    sharded = rules_lib.sharded_activation(LOGITS)
    return sharded is None or sharded[1][-1] is None


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


def _kernel(logits_ref, targets_ref, weights_ref, losses_ref, grad_ref, *, vocab: int, block: int):
    row = pl.ds(pl.program_id(0), 1)
    target = targets_ref[row][:, None]
    blocks = pl.cdiv(vocab, block)

    def columns(k):
        # The last block ends at the vocabulary's end (overlapping the one before it) rather than
        # past it, so every load stays in bounds; `fresh` marks the columns not yet visited.
        start = jnp.minimum(k * block, vocab - block)
        index = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        return pl.ds(start, block), index, index >= k * block

    def first_pass(k, carry):
        maximum, total, target_logit = carry
        cols, index, fresh = columns(k)
        x = pallas_triton.load(logits_ref.at[row, cols], eviction_policy="evict_last")
        x = jnp.where(fresh, x.astype(jnp.float32), -jnp.inf)
        new_max = jnp.maximum(maximum, jnp.max(x, axis=1))
        total = total * jnp.exp(maximum - new_max) + jnp.sum(jnp.exp(x - new_max[:, None]), axis=1)
        target_logit = target_logit + jnp.sum(jnp.where(fresh & (index == target), x, 0.0), axis=1)
        return new_max, total, target_logit

    # The running maximum starts at float32's lowest finite value, not -inf: exp(lowest - x) is 0,
    # where exp(-inf - -inf) would be nan.
    lowest = jnp.full((1,), jnp.finfo(jnp.float32).min, jnp.float32)
    zeros = jnp.zeros((1,), jnp.float32)
    maximum, total, target_logit = jax.lax.fori_loop(0, blocks, first_pass, (lowest, zeros, zeros))
    logsumexp = maximum + jnp.log(total)
    losses_ref[row] = logsumexp - target_logit
    weight = weights_ref[row][:, None]

    def second_pass(k, _):
        # The overlapping columns of the last block are written twice with the same values.
        cols, index, _ = columns(k)
        x = pallas_triton.load(logits_ref.at[row, cols], eviction_policy="evict_first").astype(jnp.float32)
        grad = (jnp.exp(x - logsumexp[:, None]) - (index == target)) * weight
        grad_ref[row, cols] = grad.astype(grad_ref.dtype)
        return 0

    jax.lax.fori_loop(0, blocks, second_pass, 0)


def _local(logits, targets, weights, *, grad_dtype, block: int = BLOCK, warps: int = WARPS):
    """The kernel on one device's (batch, length, vocab) logits: one program per row."""
    batch, length, vocab = logits.shape
    rows = batch * length
    row_weights = jnp.broadcast_to(weights.astype(jnp.float32)[:, None], (batch, length)).reshape(rows)
    losses, grad = pl.pallas_call(
        functools.partial(_kernel, vocab=vocab, block=min(block, _floor_pow2(vocab))),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows, vocab), grad_dtype)),
        grid=(rows,),
        compiler_params=pallas_triton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name="softmax_grad",
    )(logits.reshape(rows, vocab), targets.reshape(rows).astype(jnp.int32), row_weights)
    return losses.reshape(batch, length), grad.reshape(logits.shape)


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)
