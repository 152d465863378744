"""AdamW (Loshchilov and Hutter 2019): Adam's moments with decoupled weight decay, optax's `adamw`."""

from __future__ import annotations

from typing import ClassVar, Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME, OptimizerSection
from jaxdist.train.optimizers.parts import Masks
from jaxdist.train.optimizers.registry import register


class AdamWConfig(OptimizerSection):
    """The `optim:` section of AdamW (`optim.name=adamw`)."""

    name: Literal["adamw"] = Field("adamw", description=OPTIMIZER_NAME)
    moments: ClassVar[int] = 2
    b1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    b2: float = Field(0.95, ge=0, lt=1, description="second-moment decay")
    eps: float = Field(1e-8, gt=0, description="denominator epsilon")


def build(optim: AdamWConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay, mask=masks.decay)


register(AdamWConfig, build)
