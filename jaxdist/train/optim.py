"""The optimizer a config asks for: the registered optimizer's transformation (train/optimizers/),
after global-norm clipping, and the learning-rate schedule, with batch-size scaling.

`build_optimizer(cfg.optim, cfg.train, logical_names, roles)` returns the optax transformation and
the schedule of the effective learning rate (the one the step logs). Weight decay is decoupled and
scaled by the learning rate in every optimizer; norms, biases and embeddings (by the roles the model
declares) do not get it unless `optim.decay_norms_and_biases` / `optim.decay_embeddings` asks
(train/optimizers/parts.py).
"""

from __future__ import annotations

import math
from typing import Any

import optax

from jaxdist.config import OptimizerSection, TrainConfig
from jaxdist.train import optimizers
from jaxdist.train.optimizers.parts import Masks, stacked_mask, weight_decay_mask


def scaled_lr(optim: OptimizerSection, global_batch: int) -> float:
    """The peak LR for `global_batch` under `optim.lr_scaling` from `optim.base_batch`."""
    if optim.lr_scaling == "none":
        return optim.lr
    ratio = global_batch / optim.base_batch
    return optim.lr * (ratio if optim.lr_scaling == "linear" else math.sqrt(ratio))


def learning_rate_schedule(optim: OptimizerSection, train: TrainConfig) -> optax.Schedule:
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


def build_optimizer(
    optim: OptimizerSection, train: TrainConfig, logical_names: Any, roles: Any, clip: bool = True,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for `optim.name` (after global-norm clipping) and its LR schedule.

    `logical_names` is a tree like the parameters whose leaves are tuples of logical axis names
    (which say the stacked layers), `roles` one of their roles (parallel/roles.py); the masks are
    derived from them. `clip` False: without the clipping (for a caller that clips the gradients
    over all parameters itself, as train/offload.py does).
    """
    schedule = learning_rate_schedule(optim, train)
    masks = Masks(roles, weight_decay_mask(optim, roles), stacked_mask(logical_names))
    tx = optimizers.get(optim.name).build(optim, schedule, masks)
    # Clipping holds no state, and the chain has the same shape with it off: a checkpoint saved
    # without clipping resumes with it (a diverging run's usual remedy), and the other way round.
    clipping = optax.identity() if optim.clip_norm is None or not clip else optax.clip_by_global_norm(optim.clip_norm)
    return optax.chain(clipping, tx), schedule
