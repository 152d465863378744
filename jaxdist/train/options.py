"""The train step's options as objects: what the caller chooses (`StepOptions`), how the state starts
(`InitOptions`), and what the Trainer makes of the options on one mesh (`StepLayout`).

A feature of the step adds its field here and reads it where it acts (the step, the accumulation or
the state's init); the signatures between them stay as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optax
from jax.sharding import Mesh

from jaxdist.parallel import compression as compression_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import copies as copies_lib
from jaxdist.train.precision import LossScale

if TYPE_CHECKING:  # annotations only: train/state.py imports this module, and train/offload.py train/state.py
    from jaxdist.train.offload import OffloadedOptimizer
    from jaxdist.train.state import AbstractModel

GRAD_REDUCTIONS = ("per_step", "per_microbatch")
FSDP_GATHERS = ("per_layer", "per_step")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the compiled step computes one optimizer step (the config's `train` and `precision` keys,
    as `Trainer.from_config` reads them). The defaults are the plain step: one microbatch, the model
    casting as it goes, every non-finite update dropped."""

    microbatches: int = 1
    """Scan steps (gradient accumulation) per optimizer step (`train.microbatches`)."""
    grad_reduction: str = "per_step"
    """How gradients cross devices (`train.grad_reduction`, train/accumulate.py): per_step, once per
    step from each batch shard's unreduced gradients; per_microbatch, in every scan step."""
    schedule: optax.Schedule | None = None
    """The learning rate at the optimizer's step count, reported as the `learning_rate` metric
    (None: not reported)."""
    loss_scale: LossScale | None = None
    """The dynamic loss scale's starting state (float16, train/precision.py); None: no loss scaling."""
    compute_copies: Callable[[Any], Any] | None = None
    """`compute_copies(params)`: the compute-dtype copies the model reads in place of some
    parameters (e.g. `functools.partial(copies.compute_copies, picks=..., dtype=...)`), kept
    between steps and made anew by each step; None: the model casts as it goes."""
    fsdp_gather: str = "per_layer"
    """Where the copies split over the batch axes (fsdp) are gathered (`train.fsdp_gather`):
    per_layer, XLA gathers each at each use; per_step, the step gathers them whole once and keeps
    them for the backward (ZeRO-2; needs `compute_copies`)."""
    nonfinite_guard: bool = True
    """Drop an update whose loss or gradients are not finite (`precision.verdict`); False applies
    every update (to measure the guard's cost). Loss scaling keeps its own check."""
    loss_spike: float | None = None
    """A loss above this factor times the running average of the applied steps' losses is dropped
    like a non-finite step and flagged in the `loss_spike` metric (train/spikes.py); None: off."""
    compression: compression_lib.Compression | None = None
    """The gradients cross the data-parallel axes compressed (PowerSGD or int8 with error feedback,
    parallel/compression.py), from each batch shard's own gradients: needs grad_reduction per_step."""
    offload: OffloadedOptimizer | None = None
    """The optimizer state in pinned host memory, updated a parameter at a time (train/offload.py);
    it stands in for the optimizer, which then only names the optimizer for the schedule and logs."""

    def __post_init__(self):
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"grad_reduction={self.grad_reduction!r}: use one of {GRAD_REDUCTIONS}")
        if self.fsdp_gather not in FSDP_GATHERS:
            raise ValueError(f"fsdp_gather={self.fsdp_gather!r}: use one of {FSDP_GATHERS}")
        if self.fsdp_gather == "per_step" and self.compute_copies is None:
            raise ValueError("fsdp_gather=per_step gathers the compute-dtype copies: pass compute_copies")


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """How the train state starts (`state.init_state`)."""

    seed: int = 0
    """The seed of the model's random init: it is built as `create_model(nnx.Rngs(seed))`."""
    params: Callable[[Any], Any] | None = None
    """`params(param_shardings)`: the parameters to start from (e.g. published weights, made in
    those shardings) instead of the random init; the optimizer state starts as ever."""
    model_state: Callable[[Any], Any] | None = None
    """With `params`, for a model with other variables: `model_state(shardings)`, those to start
    from (a sigmoid router's published biases)."""
    materialize: bool = True
    """False describes the state without allocating it (`jax.ShapeDtypeStruct`s with their
    shardings): the step can then be compiled (`Trainer.compile` with an abstract batch), not run."""
    abstract: AbstractModel | None = None
    """`state.abstract_model(create_model, seed)`, where the caller already has it (saves a trace)."""


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The mesh and rules the step runs under, and what the step's options make of them for one
    model (the Trainer derives these from `StepOptions`; None where an option is off)."""

    mesh: Mesh
    rules: rules_lib.Rules
    copy_shardings: Any = None
    """Each compute-dtype copy's sharding, its parameter's (None where a parameter has no copy)."""
    copies_gather: copies_lib.Gather | None = None
    """Where the model's reads gather the copies to first (fsdp_gather per_step)."""
    compressed: compression_lib.Reducer | None = None
    """The compressed gradient reduction; its state is `TrainState.compression`."""
