"""A multilayer perceptron image classifier in flax NNX that names its dimensions and nothing else.

The image is flattened, passes the hidden layers (`model.hidden` widths, ReLU) and a last linear
layer gives the class logits. Each hidden layer's kernel is (`embed`, `mlp`): its input features
and its hidden units, so tensor parallelism splits the units and FSDP the inputs; the last layer's
is (`embed`, `classes`). No batch statistics: its train state has no model state.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxdist.config import MODEL_NAME, ClassCount, ClassifierSection, Config, ImageShape, ParamSize
from jaxdist.models import classifier
from jaxdist.models.registry import register
from jaxdist.parallel.rules import constrain


class MLPConfig(ClassifierSection):
    """The `model:` section of a multilayer perceptron classifier (`model.name=mlp`): the flattened image
    through ReLU layers."""

    name: Literal["mlp"] = Field("mlp", description=MODEL_NAME)
    classes: ClassCount = "auto"
    image_shape: ImageShape = "auto"
    hidden: list[Annotated[int, Field(gt=0)]] = Field(
        [256, 256], description="width of each hidden layer, first to last (its length is the depth)")

    def param_sizes(self) -> list[ParamSize]:
        sizes = []
        if self.image_shape != "auto":
            sizes.append(ParamSize("embed", "model.image_shape", self.image_shape, math.prod(self.image_shape),
                                   "the first layer's inputs height x width x channels"))
        for i, width in enumerate(self.hidden):
            # A hidden layer's outputs (mlp) are the next layer's inputs (embed).
            what = f"the width of hidden layer {i + 1} (model.hidden[{i}])"
            sizes += [ParamSize(name, "model.hidden", self.hidden, width, what) for name in ("mlp", "embed")]
        if self.classes != "auto":
            sizes.append(ParamSize("classes", "model.classes", self.classes, self.classes, "the head's outputs"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"hidden": list(self.hidden)}


def _linear(features_in: int, features_out: int, names: tuple[str, str], rngs: nnx.Rngs, param_dtype, compute_dtype):
    return nnx.Linear(features_in, features_out, kernel_metadata={"out_sharding": names},
                      bias_metadata={"out_sharding": names[1:]}, dtype=compute_dtype, param_dtype=param_dtype,
                      rngs=rngs)


def widths(cfg: MLPConfig) -> list[int]:
    """Features entering each layer, then the classes: [pixels, *hidden, classes]."""
    classes, image_shape = classifier.sizes(cfg)
    return [math.prod(image_shape), *cfg.hidden, classes]


class MLP(nnx.Module):
    """`__call__(images [B, H, W, C])` gives logits [B, classes] in the compute dtype."""

    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, compute_dtype=jnp.float32):
        sizes = widths(cfg)
        self.compute_dtype = compute_dtype
        self.hidden = nnx.List([
            _linear(features_in, features_out, ("embed", "mlp"), rngs, param_dtype, compute_dtype)
            for features_in, features_out in zip(sizes[:-2], sizes[1:-1])
        ])
        self.head = _linear(sizes[-2], sizes[-1], ("embed", "classes"), rngs, param_dtype, compute_dtype)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = constrain(images.reshape(images.shape[0], -1).astype(self.compute_dtype), ("batch", "embed"))
        for layer in self.hidden:
            x = constrain(jax.nn.relu(layer(x)), ("batch", "mlp"))
        return constrain(self.head(x), ("batch", "classes"))


def flops_per_example(cfg: Config) -> int:
    """Training FLOPs of one example: every layer's multiply-adds (`classifier.training_flops`)."""
    sizes = widths(cfg.model)
    return classifier.training_flops(sum(a * b for a, b in zip(sizes, sizes[1:])))


ENTRY = register(classifier.entry(MLPConfig, MLP, flops_per_example,
                                  (("batch", "embed"), ("batch", "mlp"), ("batch", "classes"))))
