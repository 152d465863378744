"""The GPT's loss: next-token cross-entropy as a weighted sum and its weight (models/loss.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.models.cross_entropy import fused_linear_cross_entropy
from jaxdist.models.layers import moe as moe_lib
from jaxdist.models.loss import Loss


def loss(model: nnx.Module, batch: dict[str, jax.Array]) -> Loss:
    """Next-token cross-entropy (float32), summed over the targets that count, and their number.

    Every target counts 1, or its sequence's `weights` (eval batches: 0 marks padding). Packed rows
    (`segments` and `positions`, data.packing) are scored per document, their padding (segment 0)
    left out. A model with `model.impl.loss_chunk` > 0 is scored chunk by chunk, never forming the
    full logits. A mixture of experts adds its auxiliary and z losses (models/layers/moe.py).
    """
    impl = getattr(model, "impl", None)
    chunk = getattr(impl, "loss_chunk", 0)
    segments, positions = batch.get("segments"), batch.get("positions")
    weights = batch.get("weights")
    if segments is not None:  # per token: real tokens of real rows
        weights = (segments > 0).astype(jnp.float32) * (1.0 if weights is None else weights[:, None])
    targets = batch["targets"]
    if weights is None:
        weight = jnp.float32(targets.size)
    else:
        weight = weights.sum() if weights.ndim == 2 else weights.sum() * targets.shape[1]
    features = model.features(batch["inputs"], segments, positions)
    if chunk:
        total = fused_linear_cross_entropy(features.hidden, features.head, targets, weights, chunk=chunk,
                                           logits_dtype=model.logits_dtype, impl=impl.loss_impl,
                                           softcap=model.cfg.logit_softcap)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(
            model.logits(features.hidden, features.head).astype(jnp.float32), targets)
        if weights is not None:
            losses = losses * jnp.broadcast_to(weights if weights.ndim == 2 else weights[:, None], losses.shape)
        total = losses.sum()
    if features.moe is None:
        return Loss(total, weight)
    moe = model.cfg.moe
    return moe_lib.with_penalty(Loss(total, weight), features.moe, moe,
                                [layer for layer in range(model.cfg.layers) if moe.is_moe(layer)])
