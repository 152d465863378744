"""LARS (You et al. 2017): SGD with momentum whose update is scaled by a per-layer trust ratio;
optax's `lars`, with the trust ratio masked and computed per layer of stacked parameters."""

from __future__ import annotations

from typing import ClassVar, Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME, OptimizerSection
from jaxdist.train.optimizers.parts import Masks, scale_by_layerwise_trust_ratio, trust_ratio_mask
from jaxdist.train.optimizers.registry import register


class LARSConfig(OptimizerSection):
    """The `optim:` section of LARS (`optim.name=lars`)."""

    name: Literal["lars"] = Field("lars", description=OPTIMIZER_NAME)
    moments: ClassVar[int] = 1
    momentum: float = Field(0.9, ge=0, lt=1, description="momentum")
    nesterov: bool = Field(False, description="Nesterov momentum")
    trust_coefficient: float = Field(0.001, gt=0, description="trust coefficient")
    trust_ratio_norms_and_biases: bool = Field(False, description="apply the trust ratio to norms and biases too")


def build(optim: LARSConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.chain(
        optax.add_decayed_weights(optim.weight_decay, mask=masks.decay),
        scale_by_layerwise_trust_ratio(trust_ratio_mask(optim.trust_ratio_norms_and_biases, masks.roles),
                                       masks.stacked, trust_coefficient=optim.trust_coefficient),
        optax.scale_by_learning_rate(lr),
        optax.trace(decay=optim.momentum, nesterov=optim.nesterov),
    )


register(LARSConfig, build)
