"""Models, registered by name. A model is built from the config and scored by its loss function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.models.cross_entropy import fused_linear_cross_entropy
from jaxdist.models import gpt
from jaxdist.models.gpt import GPT
from jaxdist.models import dtypes as dtypes_lib


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (float32) over every target in the batch.

    With per-sequence `weights` (eval batches: 0 marks padding) it is the weighted mean. A model
    with `impl.loss_chunk` > 0 is scored chunk by chunk, never forming the full logits.
    """
    impl = getattr(model, "impl", None)
    chunk = getattr(impl, "loss_chunk", 0)
    if chunk:
        hidden, head = model.features(batch["inputs"])
        return fused_linear_cross_entropy(
            hidden, head, batch["targets"], batch.get("weights"), chunk=chunk, logits_dtype=model.logits_dtype,
            impl=impl.loss_impl,
        )
    logits = model(batch["inputs"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    if "weights" not in batch:
        return losses.mean()
    weights = jnp.broadcast_to(batch["weights"][:, None], losses.shape)
    return (losses * weights).sum() / weights.sum()


@dataclass(frozen=True)
class ModelEntry:
    """How to build a registered model from the config, and its training loss."""

    create: Callable[[Config], Callable[[nnx.Rngs], nnx.Module]]
    loss: Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]
    # Which parameters (by pytree path) the model reads only in the compute dtype: these may be
    # kept as compute-dtype copies between steps (`precision.compute_copies`, train/copies.py).
    read_in_compute_dtype: Callable[[tuple], bool] | None = None
    # The arrays each batch must hold (checked against a `data.source=arrays` file before compiling).
    batch_keys: tuple[str, ...] = ()


def _gpt(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
    if cfg.model.vocab == "auto":
        raise UserError("model.vocab=auto is not resolved; pass the config through "
                        "jaxdist.data.loader.resolve_vocab, or set model.vocab to a number")
    dtypes = dtypes_lib.policy(cfg.precision)
    return lambda rngs: GPT(
        cfg.model, cfg.impl, rngs=rngs, param_dtype=dtypes.param_dtype, compute_dtype=dtypes.compute_dtype,
        pipeline=cfg.pipeline,
    )


MODELS: dict[str, ModelEntry] = {
    "gpt": ModelEntry(create=_gpt, loss=lm_loss, read_in_compute_dtype=gpt.read_in_compute_dtype,
                      batch_keys=("inputs", "targets")),
}


def get(name: str) -> ModelEntry:
    if name not in MODELS:
        raise UserError(f"model.name={name!r} is not a registered model; choose one of {', '.join(MODELS)}")
    return MODELS[name]
