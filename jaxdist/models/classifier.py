"""What the image classifiers share: their loss and accuracy (as weighted sums), FLOPs, a random batch.

A classification example is `{"images": [height, width, channels], "labels": int32 []}`, the
images float32 in [0, 1] or uint8 pixels, which the loss scales to [0, 1] on the device (pixel /
255: a quarter of float32's bytes cross from the host); a batch stacks them (`[B, H, W, C]`,
`[B]`), and eval batches add `weights` (1 for a real example, 0 for padding). A classifier maps
images to logits `[B, classes]`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.config import ClassifierSection, Config
from jaxdist.errors import UserError
from jaxdist.models import dtypes as dtypes_lib
from jaxdist.models.loss import Loss
from jaxdist.models.registry import ModelEntry

Batch = dict[str, jax.Array]
BATCH_KEYS = ("images", "labels")


def sizes(model_cfg: ClassifierSection) -> tuple[int, tuple[int, int, int]]:
    """(classes, image shape) of a classifier's section, once `auto` is resolved from the data."""
    for key in ("classes", "image_shape"):
        if getattr(model_cfg, key) == "auto":
            raise UserError(f"model.{key}=auto is not resolved; pass the config through "
                            f"jaxdist.data.loader.resolve_model, or set model.{key}")
    return model_cfg.classes, tuple(model_cfg.image_shape)


def unit_range(images: jax.Array) -> jax.Array:
    """`images` as floats in [0, 1]: uint8 pixels times float32(1 / 255) (what XLA makes of a division
    by 255 on some backends, so written out: every backend gives the same bits), float images as they are."""
    if images.dtype == jnp.uint8:
        return images.astype(jnp.float32) * jnp.float32(1 / 255)
    return images


def _losses_and_hits(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Per example: the float32 cross-entropy and whether the top logit is the label (1.0 or 0.0)."""
    logits = model(unit_range(batch["images"])).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    hits = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
    return losses, hits


def loss(model: nnx.Module, batch: Batch) -> Loss:
    """Summed cross-entropy and top-1 correct predictions (`accuracy`) over the batch's examples,
    each weighted by `weights` where given (eval batches: 0 marks padding), and their weight."""
    losses, hits = _losses_and_hits(model, batch)
    weights = batch.get("weights")
    if weights is None:
        return Loss(losses.sum(), jnp.float32(losses.size), {"accuracy": hits.sum()})
    return Loss((losses * weights).sum(), weights.sum(), {"accuracy": (hits * weights).sum()})


def training_flops(forward_macs: int) -> int:
    """FLOPs of one example's training step: 2 per multiply-add, and the backward pass twice the
    forward (gradients of the inputs and of the weights)."""
    return 6 * forward_macs


def random_batch(model_cfg: ClassifierSection, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """`rows` examples of uniform random pixels and labels (for `jaxdist bench`)."""
    classes, image_shape = sizes(model_cfg)
    return {
        "images": rng.random((rows, *image_shape), dtype=np.float32),
        "labels": rng.integers(0, classes, (rows,), dtype=np.int32),
    }


def entry(section: type[ClassifierSection], module: type[nnx.Module], flops_per_example: Callable[[Config], float],
          activations: tuple[tuple[str | None, ...], ...]) -> ModelEntry:
    """The `ModelEntry` of an image classifier: `module(cfg.model, rngs=..., param_dtype=...,
    compute_dtype=...)` trained by this module's loss."""
    def create(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
        sizes(cfg.model)  # `auto` resolved, or one line saying so
        dtypes = dtypes_lib.policy(cfg.precision)
        return lambda rngs: module(cfg.model, rngs=rngs, param_dtype=dtypes.param_dtype,
                                   compute_dtype=dtypes.compute_dtype)

    return ModelEntry(section=section, create=create, loss=loss,
                      flops_per_example=flops_per_example, batch_keys=BATCH_KEYS, activations=activations,
                      random_batch=lambda cfg, rng, rows: random_batch(cfg.model, rng, rows))
