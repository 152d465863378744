"""The compiled train step: one call = one global optimizer step.

Gradient accumulation is a `lax.scan` over microbatches inside the step, so a step means the
same thing at any microbatch count. The step is jitted with explicit shardings for the state and
the batch, and donates the old state's buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.parallel import rules as rules_lib
from jaxdist.train.state import TrainState

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], "jax.Array | tuple[jax.Array, dict[str, jax.Array]]"]


def batch_sharding(mesh: Mesh, rules: rules_lib.Rules) -> NamedSharding:
    """Sharding of every batch array: leading (example) dim split as the `batch` rule says."""
    return NamedSharding(mesh, rules.activation_spec(("batch",), "the input batch"))


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """(B, ...) -> (microbatches, B / microbatches, ...), each microbatch a slice of every shard.

    Rows are taken strided, so the split moves no data between devices.
    """
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
    return rules_lib.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


def _loss_and_aux(out) -> tuple[jax.Array, dict[str, jax.Array]]:
    return out if isinstance(out, tuple) else (out, {})


def loss_and_grads(
    graphdef: nnx.GraphDef, loss_fn: LossFn, params: Any, batch: Batch, microbatches: int
) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """Mean loss, mean aux metrics and mean float32 gradients over the whole global batch."""

    def loss_of(p, b):
        return _loss_and_aux(loss_fn(nnx.merge(graphdef, p), b))

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    if microbatches == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, aux, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    micro = jax.tree.map(lambda x: split_microbatches(x, microbatches), batch)

    def accumulate(total, mb):
        (loss, aux), grads = grad_fn(params, mb)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return jax.tree.map(jnp.add, total, (loss, aux, grads)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, jnp.float32),
        jax.eval_shape(lambda: (loss_of(params, first), params)),
    )
    (loss, aux), grad_zeros = zeros
    (loss, aux, grads), _ = jax.lax.scan(accumulate, (loss, aux, grad_zeros), micro)
    return jax.tree.map(lambda t: t / microbatches, (loss, aux, grads))


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | None,
    mesh: Mesh,
    rules: rules_lib.Rules,
    state_shardings: TrainState,
    microbatches: int = 1,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted `step(state, batch) -> (state, metrics)`; the input state is donated."""

    def step(state: TrainState, batch: Batch):
        with rules_lib.activation_rules(mesh, rules):
            loss, aux, grads = loss_and_grads(graphdef, loss_fn, state.params, batch, microbatches)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(mesh, rules)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
