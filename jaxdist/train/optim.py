"""Optimizers, masks, learning-rate schedules and batch-size scaling rules, built on optax.

`build_optimizer(cfg.optim, cfg.train, logical_names)` returns the optax transformation and the
schedule of the effective learning rate (the one the step logs). Masks are decided from each
parameter's logical axis names, so they hold for any model that names its dimensions:

- norms and biases: at most one dimension besides a stacked `layers` axis;
- embeddings (tables looked up by index): first axis, after `layers`, is `vocab` or `length`.

Weight decay is decoupled and scaled by the learning rate in every optimizer (adafactor too,
where optax would add it after the learning-rate scaling). Norms, biases and embeddings do not
get it unless `optim.decay_norms_and_biases` / `optim.decay_embeddings` asks;
LARS and LAMB leave norms and biases out of the trust ratio (as their papers' implementations
do) unless `optim.trust_ratio_norms_and_biases`.

Stacked layers are one array with a leading `layers` axis. LARS and LAMB define the trust ratio
per layer, so for stacked parameters it is computed per slice along that axis; otherwise the
chains are optax's `lars` and `lamb`, transformation for transformation. Adafactor's
per-parameter statistics (factored second moments, update clipping, parameter-scale RMS) are
likewise per layer: `per_layer` vmaps them over the axis.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

from jaxdist.config import OptimConfig, TrainConfig

Names = tuple[str | None, ...]
STACK_AXIS = "layers"
EMBEDDING_AXES = ("vocab", "length")


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _unstacked(names: Names) -> Names:
    return names[1:] if names[:1] == (STACK_AXIS,) else names


def is_stacked(names: Names) -> bool:
    """A parameter holding every layer, stacked along a leading `layers` axis."""
    return names[:1] == (STACK_AXIS,)


def is_norm_or_bias(names: Names) -> bool:
    """A vector per layer: norm scales and offsets, biases."""
    return len(_unstacked(names)) <= 1


def is_embedding(names: Names) -> bool:
    """A table looked up by token id or position."""
    own = _unstacked(names)
    return len(own) >= 2 and own[0] in EMBEDDING_AXES


def weight_decay_mask(optim: OptimConfig, logical_names: Any) -> Any:
    """True for the parameters that get weight decay (a tree like the parameters)."""

    def decays(names: Names) -> bool:
        if is_norm_or_bias(names):
            return optim.decay_norms_and_biases
        if is_embedding(names):
            return optim.decay_embeddings
        return True

    return jax.tree.map(decays, logical_names, is_leaf=_is_names)


def trust_ratio_mask(optim: OptimConfig, logical_names: Any) -> Any:
    """True for the parameters whose LARS/LAMB update is scaled by the trust ratio."""
    return jax.tree.map(
        lambda names: optim.trust_ratio_norms_and_biases or not is_norm_or_bias(names),
        logical_names, is_leaf=_is_names,
    )


def stacked_mask(logical_names: Any) -> Any:
    return jax.tree.map(is_stacked, logical_names, is_leaf=_is_names)


def scale_by_layerwise_trust_ratio(
    mask: Any, stacked: Any, trust_coefficient: float = 1.0, eps: float = 0.0
) -> optax.GradientTransformation:
    """`optax.scale_by_trust_ratio` where `mask` says, one ratio per layer of stacked parameters.

    `mask` and `stacked` are trees of bools like the parameters. Leaves outside the mask pass
    through unchanged; stacked leaves get ||p_l|| / ||u_l|| for each layer l separately.
    """
    ratio = optax.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)

    def scale_one(update: jax.Array, param: jax.Array) -> jax.Array:
        return ratio.update(update, ratio.init(param), param)[0]

    def scale_leaf(update, param, masked, layered):
        if not masked:
            return update
        return jax.vmap(scale_one)(update, param) if layered else scale_one(update, param)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs the parameters: pass them to update")
        return jax.tree.map(scale_leaf, updates, params, mask, stacked), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def per_layer(inner: optax.GradientTransformation, stacked: Any) -> optax.GradientTransformation:
    """`inner` with each layer of the stacked parameters as a parameter of its own.

    `stacked` is a tree of bools like the parameters. Stacked leaves go through `inner` vmapped
    over their leading `layers` axis (its state gets that axis too); the others as they are.
    """

    def init_fn(params):
        # vmap needs an array to map: there is none where no parameter is stacked, nor in the
        # placeholder tree optax.tree_map_params inits with
        return jax.vmap(inner.init)(params) if jax.tree.leaves(params) else inner.init(params)

    def update_fn(updates, state, params=None):
        if not jax.tree.leaves(updates):
            return inner.update(updates, state, params)
        return jax.vmap(inner.update)(updates, state, params)

    labels = jax.tree.map(lambda layered: "layers" if layered else "whole", stacked)
    return optax.partition({"layers": optax.GradientTransformation(init_fn, update_fn), "whole": inner}, labels)


def scaled_lr(optim: OptimConfig, global_batch: int) -> float:
    """The peak LR for `global_batch` under `optim.lr_scaling` from `optim.base_batch`."""
    if optim.lr_scaling == "none":
        return optim.lr
    ratio = global_batch / optim.base_batch
    return optim.lr * (ratio if optim.lr_scaling == "linear" else math.sqrt(ratio))


def learning_rate_schedule(optim: OptimConfig, train: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to the scaled peak, then constant, or cosine/linear decay to the floor."""
    peak = scaled_lr(optim, train.global_batch)
    floor = peak * optim.min_lr_ratio
    warmup = min(optim.warmup_steps, train.steps)
    decay_steps = max(train.steps - warmup, 1)
    if optim.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.min_lr_ratio)
    elif optim.schedule == "linear":
        after = optax.linear_schedule(peak, floor, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _base_optimizer(
    optim: OptimConfig, lr: optax.Schedule, decay: Any, trust: Any, stacked: Any
) -> optax.GradientTransformation:
    if optim.name == "adamw":
        return optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay, mask=decay)
    if optim.name == "sgd":
        return optax.chain(
            optax.add_decayed_weights(optim.weight_decay, mask=decay),
            optax.sgd(lr, momentum=optim.momentum or None, nesterov=optim.nesterov),
        )
    if optim.name == "adafactor":  # optax.adafactor, with the decay before the LR scaling, as adamw's
        return optax.chain(
            per_layer(optax.chain(
                optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0), optax.scale_by_param_block_rms(),
            ), stacked),
            optax.add_decayed_weights(optim.weight_decay, mask=decay),
            optax.scale_by_learning_rate(lr),
        )
    if optim.name == "lamb":  # optax.lamb, with a masked, per-layer trust ratio
        return optax.chain(
            optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
            optax.add_decayed_weights(optim.weight_decay, mask=decay),
            scale_by_layerwise_trust_ratio(trust, stacked),
            optax.scale_by_learning_rate(lr),
        )
    # lars: optax.lars, with a per-layer trust ratio
    return optax.chain(
        optax.add_decayed_weights(optim.weight_decay, mask=decay),
        scale_by_layerwise_trust_ratio(trust, stacked, trust_coefficient=optim.trust_coefficient),
        optax.scale_by_learning_rate(lr),
        optax.trace(decay=optim.momentum, nesterov=optim.nesterov),
    )


def build_optimizer(
    optim: OptimConfig, train: TrainConfig, logical_names: Any
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for `optim.name` (after global-norm clipping) and its LR schedule.

    `logical_names` is a tree like the parameters whose leaves are tuples of logical axis names;
    the masks are derived from it.
    """
    schedule = learning_rate_schedule(optim, train)
    tx = _base_optimizer(
        optim, schedule,
        decay=weight_decay_mask(optim, logical_names),
        trust=trust_ratio_mask(optim, logical_names),
        stacked=stacked_mask(logical_names),
    )
    # Clipping holds no state, and the chain has the same shape with it off: a checkpoint saved
    # without clipping resumes with it (a diverging run's usual remedy), and the other way round.
    clip = optax.identity() if optim.clip_norm is None else optax.clip_by_global_norm(optim.clip_norm)
    return optax.chain(clip, tx), schedule
