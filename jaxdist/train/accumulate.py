"""Gradient accumulation inside the one compiled step: a `lax.scan` over microbatches.

The step sees the whole global batch and returns the float32 mean loss and gradients over it.
The mean is the same at any split: each call of the loss returns a weighted sum and its weight
(models/loss.py: tokens that count, or examples), the calls' totals, weights and weighted gradients
are added up, and the sums are divided once by the global weight. So rows that carry padding or
packed documents weigh each token alike under any microbatch count, layout or process count.
With k microbatches it scans k times; how gradients cross devices is `train.grad_reduction`:

per_step (the default; DDP's `no_sync`): the loss is vmapped over a leading "batch shard" axis
of size data x fsdp, split over those mesh axes (`spmd_axis_name`), so each device computes the
gradient of its own rows only, with nothing to reduce. The scan adds these unreduced gradients
into a float32 carry of shape (shards, *param) and, after the scan, one sum over the shard axis
becomes one all-reduce per step at any k (XLA may turn it into a reduce-scatter where the
parameter is FSDP-sharded).
Memory: during the scan each device holds a float32 gradient of every parameter, sharded only
along non-batch axes (tensor): under FSDP that is the full parameter, not its 1/fsdp shard.

Under `train.grad_compression` (parallel/compression.py) per_step keeps each shard's gradients
apart at any k, even 1, and the compressed reduction sums them.

per_microbatch: the plain GSPMD gradient inside every scan step, reduced (and, under FSDP,
reduce-scattered to shards) k times per step; lighter on memory, heavier on the network.

Model state (BatchNorm's running averages, `TrainState.model_state`) is threaded through the
microbatches in order: each microbatch's forward pass normalizes by its own statistics, over all of
its rows on every device (parallel/batch_stats.py; also inside per_step's per-shard vmap), and
updates the running averages once. So with k microbatches BatchNorm sees k batches of
global_batch / k examples per step, and the averages move k times.

With one microbatch both are the plain gradient: XLA reduces each gradient once, where it likes,
in the dtype its last op produced: under bfloat16 compute on GPU the matmul weights' gradients
cross devices in bfloat16, unlike torch DDP's float32 (the embedding's, the head's and the norms'
stay float32; `jaxdist bench` reports the bytes as `collective_mb`). With more, per_step sums the
unreduced float32 gradients, so they cross devices in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.models.loss import Loss, as_loss
from jaxdist.parallel import batch_stats
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.microbatches import split_microbatches
from jaxdist.train import copies
from jaxdist.train import state as state_lib
from jaxdist.train.options import StepLayout, StepOptions

Batch = dict[str, jax.Array]
# A loss function returns a `Loss` (its weighted sum and weight: models/loss.py), or a plain mean
# over the batch's rows (with an optional dict of metrics), taken as rows of weight 1.
LossFn = Callable[[nnx.Module, Batch], "Loss | jax.Array | tuple[jax.Array, dict[str, jax.Array]]"]
# (params, model state, batch) -> ((scaled mean, (Loss, new model state)), grads of the scaled mean)
GradFn = Callable[[Any, Any, Batch], tuple[tuple[jax.Array, tuple[Loss, Any]], Any]]
# The vmapped axis of per_step's batch shards (a name collectives inside the vmap can use).
SHARDS = "batch_shards"


def scaled_grad_fn(graphdef: nnx.GraphDef, loss_fn: LossFn, loss_scale: jax.Array | None,
                   compute_copies: Any = None, copies_gather: copies.Gather | None = None) -> GradFn:
    """`(params, model_state, batch) -> ((scaled mean, (Loss, new model_state)), grads of the scaled mean)`.

    Each call differentiates its own mean (`Loss.mean`): the numbers one call over the whole batch
    has always had, whose gradients keep the range of a mean (no sum over thousands of tokens in
    float16). Calls over parts of a batch are weighed by their weights afterwards (`_weighted`).
    The model reads the leaves that have `compute_copies` (train/copies.py) from them, gathered
    first with `copies_gather`. `model_state` None (a model without one) stays None.
    """

    def scaled(params, model_state, batch):
        model = state_lib.merge(graphdef, copies.read_copies(params, compute_copies, copies_gather), model_state)
        loss = as_loss(loss_fn(model, batch), batch)
        mean = loss.mean
        scaled_mean = mean if loss_scale is None else mean * loss_scale.astype(mean.dtype)
        return scaled_mean, (loss, state_lib.model_state_of(model, model_state))

    return jax.value_and_grad(scaled, has_aux=True)


def _weighted(loss: Loss, grads: Any) -> tuple[Loss, Any]:
    """One call's part of the sums over a split batch: its loss sums, and its mean's float32
    gradients times its weight (the gradients of its total)."""
    return loss, jax.tree.map(lambda g: g.astype(jnp.float32) * loss.weight, grads)


def _zeros_like_shapes(tree: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)


def _reduce_per_microbatch(grad_fn: GradFn, params: Any, model_state: Any, batch: Batch, microbatches: int):
    """(the loss sums and weighted float32 gradients summed over the microbatches, the model state
    after the last); GSPMD reduces inside each scan step."""
    micro = jax.tree.map(lambda x: split_microbatches(x, microbatches), batch)

    def accumulate(carry, mb):
        total, model_state = carry
        (_, (loss, model_state)), grads = grad_fn(params, model_state, mb)
        return (jax.tree.map(jnp.add, total, _weighted(loss, grads)), model_state), None

    (_, (loss, _)), grads = jax.eval_shape(grad_fn, params, model_state, jax.tree.map(lambda x: x[0], micro))
    (total, model_state), _ = jax.lax.scan(accumulate, (_zeros_like_shapes((loss, grads)), model_state), micro)
    return total, model_state


def _unreduced_sharding(sharding: NamedSharding, axes: tuple[str, ...]) -> NamedSharding:
    """(shards, *param): the shard axis over the batch axes, the rest as the param minus those axes."""
    return NamedSharding(sharding.mesh, PartitionSpec(axes, *rules_lib.spec_without(sharding.spec, axes)))


def _per_step_shards(
    grad_fn: GradFn, params: Any, model_state: Any, batch: Batch, microbatches: int,
    mesh: Mesh, rules: rules_lib.Rules, param_shardings: Any,
):
    """(The loss sums and weighted float32 gradients summed over the microbatches, per batch shard:
    the loss sums summed over the shards, the gradients still unreduced, (shards, *param); the
    model state after the last microbatch)."""
    axes = rules_lib.shard_axes(rules)
    shards = rules_lib.axes_size(mesh, axes)
    # Inside the vmap each shard sees its own rows: the vmapped shard axis carries the
    # data-parallel axes (spmd_axis_name), and `batch` keeps only the others (a pipeline's stages).
    inner_rules = rules.override(activations={"batch": [a for a in rules_lib.batch_axes(rules) if a not in axes]})

    def shard_grads(p, s, b):
        # Batch statistics (BatchNorm) still average over every shard's rows: `SHARDS` names the
        # vmapped axis for their collectives.
        with rules_lib.activation_rules(mesh, inner_rules), batch_stats.across_shards(SHARDS):
            (_, (loss, s)), grads = grad_fn(p, s, b)
        return _weighted(loss, grads), s

    per_shard = jax.vmap(shard_grads, in_axes=(None, None, 0), axis_name=SHARDS, spmd_axis_name=axes)

    def split(x: jax.Array) -> jax.Array:
        # Within a shard the microbatches take every k-th row, as `split_microbatches`: a split of
        # the shard's rows over the other batch axes (stages) then holds a part of every microbatch,
        # and a microbatch is the same rows on any layout (batch statistics depend on which rows
        # share one).
        x = jnp.moveaxis(x.reshape(shards, x.shape[0] // (shards * microbatches), microbatches, *x.shape[1:]), 2, 0)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(None, axes)))

    micro = jax.tree.map(split, batch)
    (loss_shapes, grads_shapes), _ = jax.eval_shape(per_shard, params, model_state,
                                                   jax.tree.map(lambda x: x[0], micro))
    carry_shardings = (
        jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec(axes)), loss_shapes),
        jax.tree.map(lambda s: _unreduced_sharding(s, axes), param_shardings),
    )

    def accumulate(carry, mb):
        total, model_state = carry
        sums, model_state = per_shard(params, model_state, mb)
        total = jax.tree.map(jnp.add, total, sums)
        # Every shard's copy of the new state is the same (its statistics span all shards): take the first.
        return (jax.lax.with_sharding_constraint(total, carry_shardings),
                jax.tree.map(lambda x: x[0], model_state)), None

    zeros = jax.lax.with_sharding_constraint(_zeros_like_shapes((loss_shapes, grads_shapes)), carry_shardings)
    ((loss, grads), model_state), _ = jax.lax.scan(accumulate, (zeros, model_state), micro)
    return (jax.tree.map(lambda t: t.sum(0), loss), grads), model_state


class GradInputs(NamedTuple):
    """What `loss_and_grads` reads besides the batch: the parameters, the model state
    (`TrainState.model_state`; None without any), the parameters' compute-dtype copies the model
    reads (train/copies.py; None without), the loss scale (None without loss scaling) and the
    compressed reduction's error feedback (`TrainState.compression`; None without compression)."""

    params: Any
    model_state: Any = None
    copies: Any = None
    loss_scale: jax.Array | None = None
    compression: Any = None


class Gradients(NamedTuple):
    """What `loss_and_grads` returns: the mean loss and metrics over the global batch (each global
    sum divided once by the global weight), its float32 gradients (reduced across devices, in the
    parameters' shardings), the model state after the forward passes and the compressed
    reduction's new state (None without compression)."""

    loss: jax.Array
    aux: dict[str, jax.Array]
    grads: Any
    model_state: Any
    compression: Any = None


def loss_and_grads(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    inputs: GradInputs,
    batch: Batch,
    layout: StepLayout,
    param_shardings: Any,
    options: StepOptions = StepOptions(),
) -> Gradients:
    """The global batch's mean loss and metrics and the float32 gradients of the unscaled mean, and
    the model state (`TrainState.model_state`) after the forward passes (None stays None).

    The mean is the global total over the global weight at any split: microbatches and batch
    shards each add their totals, weights and weighted gradients, divided once at the end.
    Must be traced under `rules_lib.activation_rules(layout.mesh, layout.rules)`. With a loss scale,
    the loss is multiplied by it before differentiation and the float32 gradients divided by it
    after. The model reads `inputs.copies` where there are any, gathered first to
    `layout.copies_gather`. `layout.compressed`: the gradients cross the data-parallel axes
    compressed (parallel/compression.py), from each batch shard's own gradients (per_step at any
    microbatch count), with `inputs.compression` (its error feedback) in and the new one out.
    """
    mesh, rules, microbatches, compressed = layout.mesh, layout.rules, options.microbatches, layout.compressed
    params, model_state, loss_scale = inputs.params, inputs.model_state, inputs.loss_scale
    shards = rules_lib.axes_size(mesh, rules_lib.shard_axes(rules))
    per_shard = options.grad_reduction == "per_step" and shards > 1 and (microbatches > 1 or compressed is not None)
    if per_shard:
        # Each shard's gradients stay unreduced until after the scan: none reduce-scattered inside.
        gather = None if layout.copies_gather is None else dataclasses.replace(layout.copies_gather, split=None)
        grad_fn = scaled_grad_fn(graphdef, loss_fn, loss_scale, inputs.copies, gather)
        (loss, grads), model_state = _per_step_shards(
            grad_fn, params, model_state, batch, microbatches, mesh, rules, param_shardings
        )
    else:
        grad_fn = scaled_grad_fn(graphdef, loss_fn, loss_scale, inputs.copies, layout.copies_gather)
        if microbatches > 1:
            (loss, grads), model_state = _reduce_per_microbatch(grad_fn, params, model_state, batch, microbatches)
        else:  # one call over the whole batch: its mean's gradients are the global mean's
            (_, (loss, model_state)), grads = grad_fn(params, model_state, batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    # The weighted gradients are the totals' gradients: divided by the global weight, once.
    weight = loss.weight if per_shard or microbatches > 1 else jnp.float32(1)
    grad_divisor = weight if loss_scale is None else weight * loss_scale
    aux = {name: total / loss.weight for name, total in loss.metrics.items()}
    compression_state = inputs.compression
    if compressed is not None:
        # Each shard's share of the mean goes in: the error feedback is in the gradients' own units.
        shares = jax.tree.map(lambda g: g / grad_divisor if per_shard else g[None] / grad_divisor, grads)
        grads, compression_state = compressed(shares, compression_state, param_shardings)
    else:
        if per_shard:
            grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g.sum(0), grads), param_shardings)
        grads = jax.tree.map(lambda g: g / grad_divisor, grads)
    return Gradients(loss.total / loss.weight, aux, grads, model_state, compression_state)
