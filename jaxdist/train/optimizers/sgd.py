"""SGD with momentum (and Nesterov's), with decoupled weight decay, through optax."""

from __future__ import annotations

from typing import Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME, OptimizerSection
from jaxdist.train.optimizers.parts import Masks
from jaxdist.train.optimizers.registry import register


class SGDConfig(OptimizerSection):
    """The `optim:` section of SGD (`optim.name=sgd`)."""

    name: Literal["sgd"] = Field("sgd", description=OPTIMIZER_NAME)
    momentum: float = Field(0.9, ge=0, lt=1, description="momentum (0: none)")
    nesterov: bool = Field(False, description="Nesterov momentum")

    @property
    def moments(self) -> int:  # a momentum trace, where there is momentum
        return 1 if self.momentum else 0


def build(optim: SGDConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.chain(
        optax.add_decayed_weights(optim.weight_decay, mask=masks.decay),
        optax.sgd(lr, momentum=optim.momentum or None, nesterov=optim.nesterov),
    )


register(SGDConfig, build)
