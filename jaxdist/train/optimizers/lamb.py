"""LAMB (You et al. 2020): Adam's update scaled by a per-layer trust ratio; optax's `lamb`, with the
trust ratio masked (norms and biases left out unless asked, as the paper's implementation does)
and computed per layer of stacked parameters."""

from __future__ import annotations

from typing import Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME
from jaxdist.train.optimizers.parts import AdamMoments, Masks, scale_by_layerwise_trust_ratio, trust_ratio_mask
from jaxdist.train.optimizers.registry import register


class LAMBConfig(AdamMoments):
    """The `optim:` section of LAMB (`optim.name=lamb`)."""

    name: Literal["lamb"] = Field("lamb", description=OPTIMIZER_NAME)
    trust_ratio_norms_and_biases: bool = Field(False, description="apply the trust ratio to norms and biases too")


def build(optim: LAMBConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.chain(
        optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps),
        optax.add_decayed_weights(optim.weight_decay, mask=masks.decay),
        scale_by_layerwise_trust_ratio(trust_ratio_mask(optim.trust_ratio_norms_and_biases, masks.roles),
                                       masks.stacked),
        optax.scale_by_learning_rate(lr),
    )


register(LAMBConfig, build)
