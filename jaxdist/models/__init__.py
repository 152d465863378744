"""Models, registered by name: built from the config, trained by their loss, evaluated by their eval
sums, their work counted in FLOPs per example. `model.name` picks one (gpt, mlp, resnet); each has
its own config section (jaxdist.config.MODEL_CONFIGS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.kernels import gelu_matmul, softmax_grad
from jaxdist.models import classifier, gpt, mlp, resnet
from jaxdist.models import dtypes as dtypes_lib
from jaxdist.models.cross_entropy import fused_linear_cross_entropy
from jaxdist.models.gpt import GPT
from jaxdist.models.mlp import MLP
from jaxdist.models.resnet import ResNet


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


def lm_eval_sums(model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The eval batch's summed loss: `lm_loss` (the weighted mean) times the real sequences' weight."""
    return {"loss": lm_loss(model, batch) * batch["weights"].sum()}


@dataclass(frozen=True)
class ModelEntry:
    """How to build a registered model from the config, train it, evaluate it and count its work."""

    create: Callable[[Config], Callable[[nnx.Rngs], nnx.Module]]
    # The training loss: the mean over the batch, or (mean, {name: mean metric}) (e.g. accuracy).
    loss: Callable[[nnx.Module, dict[str, jax.Array]], jax.Array | tuple[jax.Array, dict[str, jax.Array]]]
    # Over one eval batch (with `weights`, 0 on padding): {metric: its sum over the real examples};
    # the evaluator divides the totals over the split by the total weight (train/evaluate.py).
    eval_sums: Callable[[nnx.Module, dict[str, jax.Array]], dict[str, jax.Array]]
    # Training FLOPs of one example (MFU, `jaxdist bench` and `plan`).
    flops_per_example: Callable[[Config], float]
    # `random_batch(cfg, rng, rows)`: `rows` random examples, numpy (`jaxdist bench`; `plan` takes its shapes).
    random_batch: Callable[[Config, np.random.Generator, int], dict[str, np.ndarray]]
    # The arrays each batch holds (checked against a data source before compiling).
    batch_keys: tuple[str, ...]
    # Which parameters (by pytree path) the model reads only in the compute dtype: these may be
    # kept as compute-dtype copies between steps (`precision.compute_copies`, train/copies.py).
    read_in_compute_dtype: Callable[[tuple], bool] | None = None
    # A language model: `sample:` continues a prompt after training.
    samples_text: bool = False
    # The logical names of every activation the model's loss constrains, checked against the activation
    # rules before compiling (an activation's spec is made only as the step is traced).
    activations: tuple[tuple[str | None, ...], ...] = ()


def _gpt(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
    if cfg.model.vocab == "auto":
        raise UserError("model.vocab=auto is not resolved; pass the config through "
                        "jaxdist.data.loader.resolve_model, or set model.vocab to a number")
    dtypes = dtypes_lib.policy(cfg.precision)
    return lambda rngs: GPT(
        cfg.model, cfg.impl, rngs=rngs, param_dtype=dtypes.param_dtype, compute_dtype=dtypes.compute_dtype,
        pipeline=cfg.pipeline,
    )


def _classifier(model_class: type[nnx.Module]) -> Callable[[Config], Callable[[nnx.Rngs], nnx.Module]]:
    def create(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
        classifier.sizes(cfg.model)  # `auto` resolved, or one line saying so
        dtypes = dtypes_lib.policy(cfg.precision)
        return lambda rngs: model_class(cfg.model, rngs=rngs, param_dtype=dtypes.param_dtype,
                                        compute_dtype=dtypes.compute_dtype)

    return create


def _classifier_entry(model_class: type[nnx.Module], flops_per_example: Callable[[Config], float],
                      activations: tuple[tuple[str | None, ...], ...]) -> ModelEntry:
    return ModelEntry(
        create=_classifier(model_class), loss=classifier.loss, eval_sums=classifier.eval_sums,
        flops_per_example=flops_per_example, batch_keys=classifier.BATCH_KEYS, activations=activations,
        random_batch=lambda cfg, rng, rows: classifier.random_batch(cfg.model, rng, rows),
    )


MODELS: dict[str, ModelEntry] = {
    "gpt": ModelEntry(
        create=_gpt, loss=lm_loss, eval_sums=lm_eval_sums,
        flops_per_example=lambda cfg: gpt.flops_per_token(cfg) * cfg.model.seq_len,
        random_batch=gpt.random_tokens, batch_keys=("inputs", "targets"),
        read_in_compute_dtype=gpt.read_in_compute_dtype, samples_text=True,
        activations=(gpt.RESIDUAL, gpt.HEADS, gelu_matmul.PRE_NAMES, gelu_matmul.OUT_NAMES, softmax_grad.LOGITS,
                     ("vocab", "embed"), ("embed", "vocab"), ("batch", "embed", "vocab")),
    ),
    "mlp": _classifier_entry(MLP, mlp.flops_per_example, (("batch", "embed"), ("batch", "mlp"), ("batch", "classes"))),
    "resnet": _classifier_entry(ResNet, resnet.flops_per_example,
                                (resnet.FEATURE_MAP, ("batch", "embed"), ("batch", "classes"))),
}


def get(name: str) -> ModelEntry:
    """The registered model called `name` (`model.name`); a `UserError` naming the choices otherwise."""
    if name not in MODELS:
        raise UserError(f"model.name={name!r} is not a registered model; choose one of {', '.join(MODELS)}")
    return MODELS[name]
