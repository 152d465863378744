"""Models registered by name, with what the run needs of each besides its module: its config section,
its loss, its FLOPs per example, a random batch and the arrays a batch holds.

A model is one file (or one folder): its config section (a `ModelSection` subclass whose `name`
defaults to the model's name), its flax NNX module (logical axis names only), its Hugging Face
adapter where it has one (models/hf_mapping.py says what one holds), and one registration line,
`register(ModelEntry(...))`. Nothing outside a family's own files names it. docs/architecture.md
walks through one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from jaxdist.config import Config, ModelSection, register_model
from jaxdist.errors import UserError
from jaxdist.models.loss import Loss

if TYPE_CHECKING:
    from jaxdist.models.hf_mapping import HFAdapter


@dataclass(frozen=True)
class ModelEntry:
    """How to build a registered model from the config, train it, evaluate it and count its work."""

    # The model's `model:` section (its `name` field's default is the model's name).
    section: type[ModelSection]
    create: Callable[[Config], Callable[[nnx.Rngs], nnx.Module]]
    # The loss of a batch as a weighted sum and its weight (`models.loss.Loss`, with metrics such as
    # accuracy as weighted sums too), for training and eval alike; eval batches carry `weights`
    # (0 on padding). The step and the evaluator divide the global sums once by the global weight.
    loss: Callable[[nnx.Module, dict[str, jax.Array]], Loss]
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
    # Its Hugging Face architectures both ways (`model.init_from: hf:`, `export --format hf`), if any.
    hf: HFAdapter | None = None
    # A transformer whose section has `layers`, `d_model`, `heads`, `seq_len` and `vocab`: `jaxdist
    # scale` models its traffic from them and `flops_per_example`.
    scales: bool = False

    @property
    def name(self) -> str:
        return self.section.model_fields["name"].default


MODELS: dict[str, ModelEntry] = {}


def register(entry: ModelEntry) -> ModelEntry:
    """Makes `entry` the model `model.name=<entry.name>` builds, and its section that name's `model:` keys."""
    register_model(entry.section)
    MODELS[entry.name] = entry
    return entry


def get(name: str) -> ModelEntry:
    """The registered model called `name` (`model.name`); a `UserError` naming the choices otherwise."""
    if name not in MODELS:
        raise UserError(f"model.name={name!r} is not a registered model; choose one of {', '.join(MODELS)}")
    return MODELS[name]
