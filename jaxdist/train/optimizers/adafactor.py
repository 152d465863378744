"""Adafactor (Shazeer and Stern 2018): factored second moments, update clipping and parameter-scale
RMS, per layer of stacked parameters; optax's `adafactor`, with the weight decay before the
learning-rate scaling, as in the other optimizers (optax adds it after)."""

from __future__ import annotations

from typing import ClassVar, Literal

import optax
from pydantic import Field

from jaxdist.config import OPTIMIZER_NAME, OptimizerSection
from jaxdist.train.optimizers.parts import Masks, per_layer
from jaxdist.train.optimizers.registry import register


class AdafactorConfig(OptimizerSection):
    """The `optim:` section of Adafactor (`optim.name=adafactor`); its factored statistics (a row and a
    column per matrix) count as no parameter-sized moments."""

    name: Literal["adafactor"] = Field("adafactor", description=OPTIMIZER_NAME)
    moments: ClassVar[int] = 0


def build(optim: AdafactorConfig, lr: optax.Schedule, masks: Masks) -> optax.GradientTransformation:
    return optax.chain(
        per_layer(optax.chain(
            optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0), optax.scale_by_param_block_rms(),
        ), masks.stacked),
        optax.add_decayed_weights(optim.weight_decay, mask=masks.decay),
        optax.scale_by_learning_rate(lr),
    )


register(AdafactorConfig, build)
