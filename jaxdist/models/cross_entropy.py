"""Fused linear cross-entropy: the vocabulary projection and its loss, chunked over the sequence.

The plain loss forms the full (batch, length, vocab) logits, their float32 copy for the softmax
and the logits gradient: at GPT-2 sizes these are the largest activations of the step. Here the
sequence is cut into chunks of `chunk` positions (the batch axis, and with it its sharding, stays
whole) and a `lax.scan` visits them in turn, so only one chunk's logits ever exist. Where the
sequence itself is split over devices (context parallelism), each device's part is cut into
chunks and every step of the scan takes one chunk from each part: no chunk straddles devices.

The loss is a scalar, so its gradient is known up to the incoming cotangent during the forward
pass: each chunk computes its logits, a float32 logsumexp and the loss, and at once the logits'
gradient (softmax - one-hot), the hidden states' gradient and its share of the head's gradient.
The backward pass only scales these by the cotangent. That is the unfused path's three matmuls,
with no recompute; what is saved for the backward pass is one hidden-sized and one head-sized
array instead of the logits.

All operations are plain jnp ops with logical-name constraints, so a vocabulary sharded over a
mesh axis (rules presets tp, fsdp_tp) stays sharded and XLA inserts the reductions for the
logsumexp and the hidden-state gradient. Where the vocabulary is whole on each device, the
softmax, per-row loss and logits gradient of each chunk can run as one Pallas kernel instead
(`impl`, kernels/softmax_grad.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdist.kernels import softmax_grad
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.rules import constrain

IMPLS = ("auto", "xla", "pallas")
LOGITS = softmax_grad.LOGITS  # the logits' logical axes


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
    """`cap x tanh(logits / cap)` in float32 (Gemma 2's soft cap on the output logits)."""
    return cap * jnp.tanh(logits.astype(jnp.float32) / cap)


def fused_linear_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    chunk: int,
    logits_dtype=jnp.float32,
    impl: str = "auto",
    softcap: float | None = None,
) -> jax.Array:
    """Summed cross-entropy (float32) of `softmax(hidden @ head)` against integer `targets`, the
    logits capped softly first where `softcap` is set (softcap x tanh(logit / softcap), Gemma 2's).

    hidden: (batch, length, embed) in the compute dtype; head: (embed, vocab), cast to the
    compute dtype for the matmuls (its gradient comes back in its own dtype, summed in float32);
    targets: (batch, length) integers; weights: optional (batch,) per-sequence weights, giving
    the weighted sum (eval batches: 0 marks padding), or (batch, length) per-token ones (packed
    documents: 0 marks padding); the caller divides by the weight (models/loss.py). `chunk`
    positions of every sequence are
    projected at a time and must divide `length`; logits are written in `logits_dtype`, the
    softmax is float32. `impl` (`model.impl.loss_impl`) says where the softmax and the logits' gradient
    are computed when differentiated: "xla" (a reduction and a gradient pass), "pallas" (one
    kernel per chunk, kernels/softmax_grad.py; needs the vocabulary whole on each device), or
    "auto" (the kernel on GPU where it applies, and never with `softcap`).
    """
    length = hidden.shape[1]
    if chunk <= 0 or length % chunk:
        raise ValueError(f"chunk={chunk} must be a positive divisor of the sequence length {length}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {IMPLS}")
    if weights is None:
        weights = jnp.ones(hidden.shape[:1], jnp.float32)
    if softcap is not None and impl == "pallas":
        raise ValueError("impl='pallas' does not cap the logits: use 'xla' or 'auto' with softcap")
    return _fused(chunk, jnp.dtype(logits_dtype), impl, softcap, hidden, head, targets, weights.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(chunk, logits_dtype, impl, softcap, hidden, head, targets, weights):
    return _scan_chunks(chunk, logits_dtype, softcap, hidden, head, targets, weights, with_grads=False)[0]


def _fused_fwd(chunk, logits_dtype, impl, softcap, hidden, head, targets, weights):
    kernel = softcap is None and softmax_grad.use_kernel(impl, (hidden.shape[0], chunk, head.shape[1]), logits_dtype)
    loss_sum, (d_hidden, d_head) = _scan_chunks(chunk, logits_dtype, softcap, hidden, head, targets, weights,
                                                with_grads=True, kernel=kernel)
    return loss_sum, (d_hidden, d_head)


def _fused_bwd(chunk, logits_dtype, impl, softcap, residuals, cotangent):
    d_hidden, d_head = residuals
    # The cotangent (a mean's 1 / weight) is applied here, in float32, not to the low-precision
    # logits gradient: per token it is about 1/(batch x length), which would underflow float16.
    return (
        (d_hidden.astype(jnp.float32) * cotangent).astype(d_hidden.dtype),
        (d_head * cotangent).astype(d_head.dtype),
        None,
        None,
    )


_fused.defvjp(_fused_fwd, _fused_bwd)


def _chunks(x: jax.Array, chunk: int, parts: int) -> jax.Array:
    """(batch, length, ...) -> (length / (parts x chunk), batch, parts x chunk, ...): the sequence in
    `parts` equal parts (its split over devices), each in chunks of consecutive positions; step i
    of the scan takes chunk i of every part, side by side."""
    batch, length, *rest = x.shape
    split = x.reshape(batch, parts, length // (parts * chunk), chunk, *rest)
    return jnp.moveaxis(split, 2, 0).reshape(length // (parts * chunk), batch, parts * chunk, *rest)


def _unchunk(x: jax.Array, parts: int) -> jax.Array:
    """`_chunks`' inverse: (steps, batch, parts x chunk, ...) -> (batch, length, ...)."""
    steps, batch, width, *rest = x.shape
    split = jnp.moveaxis(x.reshape(steps, batch, parts, width // parts, *rest), 0, 2)
    return split.reshape(batch, steps * width, *rest)


def _shards(logical_axis: str) -> int:
    """How many ways the enclosing `activation_rules` split an activation's logical axis (1 outside them)."""
    active = rules_lib.active()
    if active is None:
        return 1
    mesh, rules = active
    return rules_lib.axes_size(mesh, rules.activations.get(logical_axis, ()))


def reduce_logits(logits: jax.Array, is_target: jax.Array, *, one_pass: bool) -> tuple[jax.Array, jax.Array]:
    """(logsumexp, the target's logit) over the last axis of float32 `logits`.

    `one_pass`: a single variadic reduction carries the running maximum, the sum of exponentials
    relative to it, and the target's logit, so the logits are read once instead of twice (max,
    then sum) and each element costs one `exp`. Its combiner is no sum or max, so it needs the
    vocabulary unsplit: XLA's cross-device reductions only sum, max, min or multiply.
    """
    if not one_pass:
        return jax.nn.logsumexp(logits, axis=-1), jnp.where(is_target, logits, 0.0).sum(-1)

    def combine(left, right):
        (max_l, sum_l, target_l), (max_r, sum_r, target_r) = left, right
        # exp(smaller max - larger max) rescales the sum taken against the smaller one.
        rescale = jnp.exp(-jnp.abs(max_l - max_r))
        total = jnp.where(max_r > max_l, sum_l * rescale + sum_r, sum_l + sum_r * rescale)
        return jnp.maximum(max_l, max_r), total, target_l + target_r

    # Each element enters as (itself, exp(0) = 1, its logit if it is the target); the identity's
    # maximum is float32's lowest finite value, not -inf, so that combining two identities gives
    # exp(0), not exp(-inf + inf) = nan.
    identity = (jnp.float32(jnp.finfo(jnp.float32).min), jnp.float32(0.0), jnp.float32(0.0))
    operands = (logits, jnp.ones_like(logits), jnp.where(is_target, logits, 0.0))
    maximum, total, target_logit = jax.lax.reduce(operands, identity, combine, (logits.ndim - 1,))
    return maximum + jnp.log(total), target_logit


def xla_loss_and_grad(logits, targets, weights, *, grad_dtype, one_pass: bool):
    """`softmax_grad.loss_and_grad` as XLA ops: (per-row loss, `(softmax - one-hot) * weights`).

    A reduction (`reduce_logits`) and a gradient pass over the float32 logits; it also takes a
    vocabulary split over devices (`one_pass` False). The gradient, unused, costs nothing: XLA
    drops it when the loss is not differentiated.
    """
    logits = logits.astype(jnp.float32)
    # A compare against iota, not a gather: it stays elementwise over a sharded vocabulary.
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    logsumexp, target_logit = reduce_logits(logits, is_target, one_pass=one_pass)
    d_logits = (jnp.exp(logits - logsumexp[..., None]) - is_target) * weights[:, None, None]
    return logsumexp - target_logit, d_logits.astype(grad_dtype)


def _scan_chunks(chunk, logits_dtype, softcap, hidden, head, targets, weights, *, with_grads: bool,
                 kernel: bool = False):
    """(weighted loss sum, (unnormalized d_hidden, d_head) or None) over every chunk.

    d_hidden has hidden's dtype; d_head is summed in float32 and returned in head's dtype.
    `kernel`: each chunk's softmax, per-row loss and logits gradient by kernels/softmax_grad.py.
    """
    batch, length, embed = hidden.shape
    vocab = head.shape[1]
    # Laid out as the logits' matmul reads it (whole over `fsdp`) before the loop, so it is gathered
    # once: left to XLA on GPU, the gather of an fsdp-split head ran inside it, once per chunk.
    head_c = constrain(head.astype(hidden.dtype), ("embed", "vocab"))
    # The head's gradient sums over the batch and the sequence, which may be split over devices.
    # Each batch shard and sequence part keeps its own partial sum in the carry (leading axes on
    # the batch's and the length's mesh axes), so it is reduced across devices once, after the
    # scan, rather than in every chunk. The losses are kept per part for the same reason.
    shards = _shards("batch")
    parts = _shards("length")
    if length % (parts * chunk):  # a part that is no whole number of chunks: chunks straddle parts
        parts = 1
    per_part = ("batch", "length" if parts > 1 else None)  # the partial sums' logical axes
    vocab_sharded = _shards("vocab") > 1

    def by_shard(x: jax.Array) -> jax.Array:  # (batch, parts x chunk, ...) -> (shards, rows, parts, chunk, ...)
        return x.reshape(shards, batch // shards, parts, chunk, *x.shape[2:])

    # Per-token weights ride with their chunk and scale its losses and gradient after the softmax,
    # which itself sees weight 1 per sequence.
    per_token = weights.ndim == 2
    sequence_weights = jnp.ones((batch,), jnp.float32) if per_token else weights

    def body(carry, xs):
        hidden_c, targets_c, *token_weights = xs
        logits = jnp.einsum("bcd,dv->bcv", hidden_c, head_c, preferred_element_type=logits_dtype)
        logits = constrain(logits, LOGITS)
        if softcap is not None:
            capped = soft_cap(logits, softcap)
            logits = capped.astype(logits.dtype)
        if kernel:
            row_losses, d_logits = softmax_grad.loss_and_grad(logits, targets_c, sequence_weights,
                                                              grad_dtype=hidden.dtype)
        else:
            row_losses, d_logits = xla_loss_and_grad(logits, targets_c, sequence_weights, grad_dtype=hidden.dtype,
                                                     one_pass=not vocab_sharded)
        if per_token:
            row_losses = row_losses * token_weights[0]
            d_logits = d_logits * token_weights[0][..., None].astype(d_logits.dtype)
        part_losses = constrain(carry[0] + row_losses.reshape(batch, parts, chunk).sum(-1), per_part)
        if not with_grads:
            return (part_losses,), None
        if softcap is not None:  # through the cap: d tanh(u) = 1 - tanh(u)^2
            d_logits = (d_logits.astype(jnp.float32) * (1 - jnp.square(capped / softcap))).astype(d_logits.dtype)
        d_logits = constrain(d_logits, LOGITS)
        d_hidden_c = constrain(jnp.einsum("bcv,dv->bcd", d_logits, head_c), ("batch", "length", "embed"))
        d_head_c = jnp.einsum("sbpcd,sbpcv->spdv", by_shard(hidden_c), by_shard(d_logits),
                              preferred_element_type=jnp.float32)
        return (part_losses, constrain(carry[1] + d_head_c, (*per_part, "embed", "vocab"))), d_hidden_c

    init = (constrain(jnp.zeros((batch, parts), jnp.float32), per_part),)
    if with_grads:
        init += (constrain(jnp.zeros((shards, parts, embed, vocab), jnp.float32), (*per_part, "embed", "vocab")),)
    xs = tuple(_chunks(x, chunk, parts) for x in (hidden, targets, *([weights] if per_token else [])))
    carry, d_hidden = jax.lax.scan(body, init, xs)
    loss_sum = (carry[0].sum(-1) * sequence_weights).sum()
    if not with_grads:
        return loss_sum, None
    return loss_sum, (_unchunk(d_hidden, parts), carry[1].sum((0, 1)).astype(head.dtype))
