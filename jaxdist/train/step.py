"""The compiled train step: one call = one global optimizer step.

Gradient accumulation is a `lax.scan` over microbatches inside the step (train/accumulate.py),
so a step means the same thing at any microbatch count. The step is jitted with explicit
shardings for the state and the batch, and donates the old state's buffers. A step whose loss or
gradients are not finite keeps the old parameters, optimizer state and model state (`precision.verdict` says
which steps are dropped and which are bad; under float16 the loss scale decides too), so the
state never holds a non-finite update; the step counter still advances, as the data moves on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.feed import batch_sharding
from jaxdist.train import precision
from jaxdist.train.accumulate import Batch, GradInputs, LossFn, loss_and_grads
from jaxdist.train.options import StepLayout, StepOptions
from jaxdist.train.state import TrainState


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    layout: StepLayout,
    state_shardings: TrainState,
    options: StepOptions = StepOptions(),
) -> Callable[[TrainState, Any, Batch], tuple[TrainState, Any, dict[str, jax.Array]]]:
    """The jitted `step(state, copies, batch) -> (state, copies, metrics)`; state and copies are donated.

    `copies` are the parameters' compute-dtype copies that the model reads (`options.compute_copies(params)`,
    train/copies.py, sharded as `layout.copy_shardings`), made anew from the updated parameters; None
    without them. Metrics: `loss`, `grad_norm` (before clipping), the effective `learning_rate`
    (`options.schedule` at the optimizer's own step count), the loss function's aux values,
    `nonfinite` (1 when this step was bad, else 0), `skipped_steps` (dropped updates so far), under
    loss scaling `loss_scale`, and with `options.loss_spike` the flag `loss_spike` and the running
    average `loss_average`. Under `options.offload` the optimizer state lives in host memory and is
    updated a parameter at a time (train/offload.py; `tx` is then unused).
    """
    mesh, rules, loss_spike, offload = layout.mesh, layout.rules, options.loss_spike, options.offload

    def step(state: TrainState, copies: Any, batch: Batch):
        scale = state.loss_scale
        with rules_lib.activation_rules(mesh, rules):
            inputs = GradInputs(state.params, state.model_state, copies, None if scale is None else scale.scale,
                                state.compression)
            loss, aux, grads, model_state, compression = loss_and_grads(
                graphdef, loss_fn, inputs, batch, layout, state_shardings.params, options)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": loss, "grad_norm": grad_norm, **aux}
        skipped = state.skipped_steps
        applied = jnp.isfinite(loss)  # which losses the running average takes in
        guarded = options.nonfinite_guard or scale is not None
        if guarded:
            finite, bad = precision.verdict(loss, grad_norm, scale)
            applied = finite
            if loss_spike is not None and state.loss_stats is not None:
                spike = state.loss_stats.is_spike(loss, loss_spike)
                applied, bad = finite & ~spike, bad | spike
                metrics["loss_spike"] = spike.astype(jnp.int32)
                metrics["loss_average"] = state.loss_stats.average
            skipped = skipped + (~applied).astype(skipped.dtype)
            metrics["nonfinite"] = bad.astype(jnp.int32)
            if scale is not None:  # a spike is no overflow: the scale follows finiteness alone
                scale = scale.adjust(finite)
                metrics["loss_scale"] = scale.scale
        if offload is not None:  # the state in host memory, updated a parameter at a time
            params, opt_state = offload.apply(grads, grad_norm, state.opt_state, state.params,
                                              applied if guarded else jnp.bool_(True), state_shardings.opt_state)
        else:
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            # The gradients are float32: the moments of bfloat16 parameters would come back promoted.
            opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
            params = optax.apply_updates(state.params, updates)
        if guarded:
            # A select per leaf, fused into the update: the old buffers are read, not copied (offloaded,
            # each parameter and its state are selected as they are updated).
            model_state, compression = precision.keep_if_not_finite(
                applied, (model_state, compression), (state.model_state, state.compression))
            if offload is None:
                params, opt_state = precision.keep_if_not_finite(
                    applied, (params, opt_state), (state.params, state.opt_state))
        metrics["skipped_steps"] = skipped
        loss_stats = None if state.loss_stats is None else state.loss_stats.updated(loss, applied)
        if options.schedule is not None:  # dropped steps leave the optimizer's own count behind
            metrics["learning_rate"] = options.schedule(state.step - state.skipped_steps)
        new_state = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, skipped_steps=skipped, loss_scale=scale,
            model_state=model_state, loss_stats=loss_stats, compression=compression,
        )
        return new_state, None if options.compute_copies is None else options.compute_copies(params), metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(state_shardings, layout.copy_shardings, batch_sharding(mesh, rules)),
        out_shardings=(state_shardings, layout.copy_shardings, replicated),
        donate_argnums=(0, 1),
    )


def copies_shardings(make_copies: Callable[[Any], Any], params: Any, param_shardings: Any) -> Any:
    """Each compute-dtype copy sharded as its parameter; None where a parameter has no copy."""
    picked = jax.eval_shape(make_copies, params)
    return jax.tree.map(lambda sharding, copy: None if copy is None else sharding, param_shardings, picked)
