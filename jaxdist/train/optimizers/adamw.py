"""AdamW (Loshchilov and Hutter 2019): Adam's moments with decoupled weight decay, optax's `adamw`."""

from __future__ import annotations

from typing import Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME
from jaxdist.train.optimizers.parts import AdamMoments, Masks
from jaxdist.train.optimizers.registry import register


class AdamWConfig(AdamMoments):
    """The `optim:` section of AdamW (`optim.name=adamw`)."""

    name: Literal["adamw"] = Field("adamw", description=OPTIMIZER_NAME)


def build(optim: AdamWConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay, mask=masks.decay)


register(AdamWConfig, build)
