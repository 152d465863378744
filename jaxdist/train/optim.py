"""Optimizers and learning-rate schedules from config, built on optax."""

from __future__ import annotations

import optax

from jaxdist.config import OptimConfig, TrainConfig


def learning_rate_schedule(optim: OptimConfig, train: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0, then constant or cosine decay to 0 at the last step."""
    decay_steps = max(train.steps - optim.warmup_steps, 1)
    if optim.schedule == "cosine":
        after = optax.cosine_decay_schedule(optim.lr, decay_steps)
    else:
        after = optax.constant_schedule(optim.lr)
    if not optim.warmup_steps:
        return after
    warmup = optax.linear_schedule(0.0, optim.lr, optim.warmup_steps)
    return optax.join_schedules([warmup, after], [optim.warmup_steps])


def build_optimizer(optim: OptimConfig, train: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for `optim.name`, with global-norm clipping; and its schedule."""
    schedule = learning_rate_schedule(optim, train)
    if optim.name == "adamw":
        tx = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    else:
        tx = optax.sgd(schedule, momentum=optim.momentum or None)
    if optim.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(optim.clip_norm), tx)
    return tx, schedule
