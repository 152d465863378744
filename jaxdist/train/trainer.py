"""`Trainer`: the Python API. Any flax NNX model with logical axis names trains through it.

    trainer = Trainer(lambda rngs: MyModel(rngs=rngs), my_loss, optax.adamw(1e-3),
                      mesh=make_mesh(fsdp=4, tensor=2), rules=rules.preset("fsdp_tp"),
                      options=StepOptions(microbatches=4))
    metrics = trainer.step({"x": local_x, "y": local_y})

The CLI's training loop is built on the same object, from a config: `Trainer.from_config(cfg)`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist import models
from jaxdist.config import Config
from jaxdist.errors import UserError
from jaxdist.parallel import compression as compression_lib
from jaxdist.parallel import feed
from jaxdist.parallel import layout as layout_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train import copies as copies_lib
from jaxdist.models import dtypes as dtypes_lib
from jaxdist.train import offload as offload_lib
from jaxdist.train import precision
from jaxdist.train.optim import build_optimizer
from jaxdist.train.options import InitOptions, StepLayout, StepOptions
from jaxdist.train.state import (AbstractModel, ModelFactory, TrainState, abstract_model, init_state, merge,
                                 param_shardings, with_shardings)
from jaxdist.train.step import LossFn, copies_shardings, make_train_step


class Trainer:
    """Owns the sharded train state and the compiled step for one model on one mesh."""

    def __init__(
        self,
        create_model: ModelFactory,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        rules: rules_lib.Rules,
        *,
        options: StepOptions = StepOptions(),
        init: InitOptions = InitOptions(),
    ):
        """`options`: how the step computes (microbatches, gradient reduction, compute copies, guards,
        compression, offload; `StepOptions`). `init`: how the state starts (the seed, given
        parameters, described or allocated; `InitOptions`). Under `options.offload` the offloaded
        optimizer stands in for `optimizer`, which then only names the optimizer for the schedule and logs.
        """
        self.mesh = mesh
        self.rules = rules
        init = dataclasses.replace(init, abstract=init.abstract or abstract_model(create_model, init.seed))
        layout = step_layout(init.abstract, mesh, rules, options)
        self.state, self.state_shardings, self.graphdef, self.layouts = init_state(
            create_model, optimizer, layout, init, options)
        # The first step donates these buffers; let their init finish first (an in-flight
        # donated init aborted the XLA CPU runtime under load).
        self.state = jax.block_until_ready(self.state) if init.materialize else self.state
        self.materialized = init.materialize
        self.batch_sharding = feed.batch_sharding(mesh, rules)
        self._check_batch_norm(options, layout)
        self._make_copies = None
        if options.compute_copies is not None:
            self._make_copies = jax.jit(options.compute_copies, out_shardings=layout.copy_shardings)
        self._copies, self._copies_of, self._copy_shardings = None, None, layout.copy_shardings
        self._step = make_train_step(self.graphdef, loss_fn, optimizer, layout, self.state_shardings, options)
        # Its own program, run only where a step is logged: inside the step, the norm's reduction
        # kept XLA from writing the compute copies in the update's pass (a second read of every
        # parameter per step; benchmarks/reports/2026-11-27-param-norm-qkv-sums.md).
        self._param_norm = jax.jit(optax.tree.norm, out_shardings=NamedSharding(mesh, PartitionSpec()))
        self._compiled = None
        self.trace_time_s: float | None = None
        self.compile_time_s: float | None = None
        # XLA's in-process CPU collectives can deadlock when two steps overlap on simulated
        # devices (a rendezvous waits 40 s for a device thread busy in the next step, then aborts;
        # seen under load). On CPU there is little to overlap anyway, so each step finishes first.
        self.finish_each_step = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1

    @classmethod
    def from_config(cls, cfg: Config, devices: list | None = None, layout: layout_lib.Layout | None = None,
                    materialize: bool = True, abstract: AbstractModel | None = None,
                    params: Callable[[Any], Any] | None = None,
                    model_state: Callable[[Any], Any] | None = None) -> Trainer:
        """Checks the config against the devices, then builds the mesh, the sharded state and the step
        for the registered model `cfg.model.name`.

        `layout`: `jaxdist.parallel.layout.from_config(cfg, devices)`, where the caller already has it.
        `materialize`, `abstract`, `params` and `model_state`: as `InitOptions`' (the seed is `cfg.seed`).
        """
        entry = models.get(cfg.model.name)
        layout = layout or layout_lib.from_config(cfg, devices, entry.activations)
        mesh, rules = layout.mesh, layout.rules
        platform = mesh.devices.flat[0].platform
        dtypes_lib.check_backend(cfg.precision, platform)
        create_model = entry.create(cfg)
        abstract = abstract or abstract_model(create_model, cfg.seed)
        tx, schedule = build_optimizer(cfg.optim, cfg.train, abstract.names, abstract.roles)
        make_copies = None
        dtypes = dtypes_lib.policy(cfg.precision, platform)
        if cfg.precision.compute_copies and entry.read_in_compute_dtype is not None:
            make_copies = functools.partial(copies_lib.compute_copies, picks=entry.read_in_compute_dtype,
                                            dtype=dtypes.compute_dtype)
        if cfg.train.fsdp_gather != "per_layer" and (make_copies is None or dtypes.compute_dtype == dtypes.param_dtype):
            raise UserError(
                f"train.fsdp_gather={cfg.train.fsdp_gather} gathers the weights' compute-dtype copies, and here there are none "
                f"(model {cfg.model.name}, compute {dtypes.compute_dtype.name}, params {dtypes.param_dtype.name}): "
                f"use per_layer, or a compute dtype other than the parameters'"
            )
        offload = None if cfg.train.offload == "none" else offload_lib.OffloadedOptimizer(
            lambda names, roles: build_optimizer(cfg.optim, cfg.train, names, roles, clip=False)[0],
            abstract.names, abstract.roles, cfg.optim.clip_norm)
        options = StepOptions(
            microbatches=cfg.train.microbatches, grad_reduction=cfg.train.grad_reduction, schedule=schedule,
            loss_scale=precision.initial_loss_scale(cfg.precision), compute_copies=make_copies,
            fsdp_gather=cfg.train.fsdp_gather, loss_spike=cfg.train.loss_spike,
            compression=compression_of(cfg, layout.rules), offload=offload,
        )
        init = InitOptions(seed=cfg.seed, params=params, model_state=model_state, materialize=materialize,
                           abstract=abstract)
        return cls(create_model, entry.loss, tx, mesh, rules, options=options, init=init)

    def _check_batch_norm(self, options: StepOptions, layout: StepLayout) -> None:
        """flax's BatchNorm takes its statistics from the rows it sees: refused where those are one
        batch shard's (train/accumulate.py's per-shard gradients)."""
        shards = rules_lib.axes_size(self.mesh, rules_lib.shard_axes(self.rules))
        per_shard = options.microbatches > 1 or layout.compressed is not None
        if per_shard and options.grad_reduction == "per_step" and shards > 1 and self._has_flax_batch_norm():
            raise ValueError(
                "flax's nnx.BatchNorm would take its statistics from one batch shard inside grad_reduction="
                "'per_step''s per-shard gradients: use jaxdist.models.batchnorm.BatchNorm (statistics over the "
                "whole batch everywhere) or grad_reduction='per_microbatch'")

    def _has_flax_batch_norm(self) -> bool:
        if self.state.model_state is None:  # no batch statistics at all
            return False
        model = merge(self.graphdef, self.state.params, self.state.model_state)
        return any(isinstance(node, nnx.BatchNorm) for _, node in nnx.iter_graph(model))

    def process_rows(self, global_batch: int) -> feed.BatchRows:
        """Which rows of a global batch of `global_batch` rows this process must feed: those its
        devices hold under the batch sharding (processes that hold the same rows feed the same ones)."""
        return feed.process_rows(self.batch_sharding, global_batch)

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows (`process_rows`, in order) -> the global batch, sharded over the mesh."""
        return feed.assemble(local, self.batch_sharding)

    def compile(self, batch: dict[str, jax.Array]) -> None:
        """Compiles the step ahead of time for this batch's shapes, timed in two parts:
        `trace_time_s`, tracing the step and lowering it to StableHLO (every start pays it), and
        `compile_time_s`, XLA's compile of that program (which JAX's persistent compilation cache,
        where on, replaces by a load on later starts)."""
        start = time.perf_counter()
        lowered = self._step.lower(self.state, self.current_copies(), batch)
        traced = time.perf_counter()
        self._compiled = lowered.compile()
        self.trace_time_s, self.compile_time_s = traced - start, time.perf_counter() - traced

    def step(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        """One optimizer step on a global batch (or this process's local numpy rows)."""
        if not all(isinstance(v, jax.Array) for v in batch.values()):
            batch = self.global_batch(batch)
        if self._compiled is None:
            self.compile(batch)
        self.state, self._copies, metrics = self._compiled(self.state, self.current_copies(), batch)
        self._copies_of = self.state
        if self.finish_each_step:
            jax.block_until_ready(metrics)
        return metrics

    def param_norm(self) -> jax.Array:
        """The global L2 norm of the current parameters (after the last step's update), replicated."""
        return self._param_norm(self.state.params)

    def current_copies(self) -> Any:
        """The compute-dtype copies of `self.state`'s parameters, made anew if the state was replaced
        since the last step (a restore)."""
        if self._make_copies is not None and self._copies_of is not self.state:
            if self.materialized:
                self._copies = self._make_copies(self.state.params)
            else:
                self._copies = with_shardings(jax.eval_shape(self._make_copies, self.state.params), self._copy_shardings)
            self._copies_of = self.state
        return self._copies

    @property
    def compiled(self) -> jax.stages.Compiled:
        """The compiled step (call `compile` or `step` first): its memory and cost analyses, its HLO."""
        if self._compiled is None:
            raise RuntimeError("the step is not compiled yet: call compile(batch) first")
        return self._compiled

    def compiled_text(self) -> str:
        """The compiled step's HLO after SPMD partitioning (call `compile` or `step` first)."""
        if self._compiled is None:
            raise RuntimeError("the step is not compiled yet: call compile(batch) first")
        return self._compiled.as_text()

    @property
    def params(self) -> Any:
        """The current parameters (a pytree of sharded arrays, in `precision.params`)."""
        return self.state.params


def step_layout(abstract: AbstractModel, mesh: Mesh, rules: rules_lib.Rules, options: StepOptions) -> StepLayout:
    """What `options` make of `mesh` and `rules` for this model: the copies' shardings and gather, and
    the compressed reduction."""
    data_axes = rules_lib.shard_axes(rules)
    compressed = None if options.compression is None else compression_lib.reducer(
        abstract.params, abstract.names, abstract.roles, options.compression, mesh, data_axes)
    if compressed is not None and options.grad_reduction != "per_step":
        raise ValueError("gradient compression starts from each batch shard's own gradients: use "
                         "grad_reduction='per_step'")
    copy_shardings, copies_gather = None, None
    if options.compute_copies is not None:
        copy_shardings = copies_shardings(options.compute_copies, abstract.params,
                                          param_shardings(abstract, rules, mesh))
        if options.fsdp_gather == "per_step":
            # ZeRO-2: each copy whole along the data-parallel axes (data, fsdp), still split
            # along the others (tensor, stage).
            whole = jax.tree.map(lambda s: NamedSharding(s.mesh, rules_lib.spec_without(s.spec, data_axes)),
                                 copy_shardings)
            copies_gather = copies_lib.Gather(whole=whole, split=copy_shardings)
    return StepLayout(mesh, rules, copy_shardings, copies_gather, compressed)


def compression_of(cfg: Config, rules: rules_lib.Rules) -> compression_lib.Compression | None:
    """`train.grad_compression` as a `Compression` (None for none): over `train.grad_compression_axes`,
    or every data-parallel axis."""
    train = cfg.train
    if train.grad_compression == "none":
        return None
    data_axes = rules_lib.shard_axes(rules)
    axes = tuple(train.grad_compression_axes or data_axes)
    if not set(axes) <= set(data_axes):
        raise UserError(f"train.grad_compression_axes={list(axes)}: the gradients are reduced over the data-parallel "
                        f"mesh axes {list(data_axes)}; name one or more of those")
    return compression_lib.Compression(train.grad_compression, axes, train.grad_compression_rank, cfg.seed,
                                       train.grad_compression_start)


def param_layouts(cfg: Config, devices: list | None = None) -> Any:
    """Each parameter's checked placement under this config, computed without allocating or compiling."""
    entry = models.get(cfg.model.name)
    layout = layout_lib.from_config(cfg, devices, entry.activations)
    abstract = abstract_model(entry.create(cfg), cfg.seed)
    return rules_lib.param_layouts(abstract.params, abstract.names, layout.rules, layout.mesh)


def state_bytes_per_device(state: TrainState) -> dict[Any, int]:
    """Bytes of the state each device holds (params + optimizer state + model state + step)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device
