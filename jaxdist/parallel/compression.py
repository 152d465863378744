"""Compressed gradient reduction over the data-parallel axes: PowerSGD and int8, with error feedback.

Between hosts joined by Ethernet the gradient all-reduce, not the matmuls, sets the step time.
Here each batch shard's gradient (train/accumulate.py's per_step reduction leaves them unreduced)
crosses the compressed axes in fewer bytes, in explicit collectives (`jax.shard_map`) inside the
one compiled step:

- powersgd (Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization"): each matrix-shaped gradient M (stacked layers are a batch of
  matrices) is sent as two rank-r factors. P = sum_i M_i Q is all-reduced and orthonormalized,
  then Q' = sum_i M_i^T P is all-reduced, and P Q'^T is the reduced gradient: (n + m) r numbers
  instead of n m. Q' starts the next step's power iteration (the warm start).
- int8: each shard's gradient in int8 with one float32 scale per block of 256, reduce-scattered
  by an all-to-all (each device sums one chunk from every shard in float32), requantized and
  all-gathered: about a quarter of a float32 all-reduce's bytes.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019) makes both converge like the exact
reduction: what a shard's compression left out is added to its next gradient. The left-out parts
sum, over the shards, to exactly what the reduced gradient lacks. The error buffers (one float32
gradient per shard) and PowerSGD's Q are part of the train state: checkpointed and resumed.

Biases and norms (by the roles the model declares, parallel/roles.py) are reduced exactly under
both methods; so are weights whose factors would not be smaller under powersgd, and, under int8,
gradients of fewer than 4,096 numbers. The reduction over data-parallel axes left out of
`Compression.axes` (e.g. `fsdp` within a host) is exact and comes first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.parallel import roles as roles_lib
from jaxdist.parallel import rules as rules_lib

METHODS = ("none", "powersgd", "int8")
INT8_BLOCK = 256  # numbers per int8 scale
INT8_MIN_SIZE = 16 * INT8_BLOCK  # smaller gradients are reduced exactly under int8 too
# Leading dimensions of these logical names stack independent matrices (one per layer, or q/k/v).
_STACKED = ("layers", "qkv")


@dataclasses.dataclass(frozen=True)
class Compression:
    """How the gradient reduction over `axes` (data-parallel mesh axes) is compressed."""

    method: str
    axes: tuple[str, ...]
    rank: int = 4
    seed: int = 0
    start: int = 0  # reductions done exactly before compression starts (the error feedback stays zero)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one gradient is reduced: `method` exact, powersgd or int8; under powersgd `matrix` is
    (stacked dims, rows, columns) of its low-rank factors."""

    shape: tuple[int, ...]
    method: str = "exact"
    matrix: tuple[tuple[int, ...], int, int] | None = None


class CompressionState(flax.struct.PyTreeNode):
    """`error`: per gradient, each shard's left-out part (shards, *param) in float32, None where the
    reduction is exact. `basis`: powersgd's Q per matrix (stacked..., columns, rank), else None.
    `reductions`: how many reductions this state has seen (the exact warm-up counts them)."""

    error: Any
    basis: Any
    reductions: jax.Array


def _matrix(shape: tuple[int, ...], names: Sequence[str | None], rank: int):
    """(stacked dims, rows, columns): the leading stacked dims, then the split of the rest into the
    squarest matrix; None where rank-`rank` factors would not be smaller than the matrix."""
    stacked = 0
    while stacked < len(shape) and names[stacked] in _STACKED:
        stacked += 1
    inner = shape[stacked:]
    if len(inner) < 2:
        return None
    splits = [(math.prod(inner[:k]), math.prod(inner[k:])) for k in range(1, len(inner))]
    rows, cols = min(splits, key=lambda rc: rc[0] + rc[1])
    if (rows + cols) * rank >= rows * cols:
        return None
    return tuple(shape[:stacked]), rows, cols


def leaf_plans(abstract_params: Any, names: Any, roles: Any, compression: Compression) -> Any:
    """A `LeafPlan` per parameter (a tree like the parameters): weights and embeddings compressed,
    biases and norms (by their roles, parallel/roles.py) reduced exactly."""
    def leaf(param, leaf_names, role):
        shape = tuple(param.shape)
        if not roles_lib.is_weight(role):
            return LeafPlan(shape)
        if compression.method == "powersgd":
            matrix = _matrix(shape, leaf_names, compression.rank)
            return LeafPlan(shape, "exact" if matrix is None else "powersgd", matrix)
        if compression.method == "int8" and math.prod(shape) >= INT8_MIN_SIZE:
            return LeafPlan(shape, "int8")
        return LeafPlan(shape)

    return jax.tree.map(leaf, abstract_params, names, roles)


def _is_leaf_plan(x: Any) -> bool:
    return isinstance(x, LeafPlan)


def init(plans: Any, compression: Compression, shards: int) -> CompressionState:
    """The state before the first step: no error yet; Q drawn from `compression.seed` (the same on
    every process)."""
    leaves, treedef = jax.tree.flatten(plans, is_leaf=_is_leaf_plan)
    keys = jax.random.split(jax.random.key(compression.seed), max(len(leaves), 1))
    errors, bases = [], []
    for key, leaf in zip(keys, leaves):
        errors.append(jnp.zeros((shards, *leaf.shape), jnp.float32) if leaf.method != "exact" else None)
        if leaf.matrix is None:
            bases.append(None)
        else:
            stacked, _, cols = leaf.matrix
            bases.append(jax.random.normal(key, (*stacked, cols, compression.rank), jnp.float32))
    return CompressionState(error=jax.tree.unflatten(treedef, errors), basis=jax.tree.unflatten(treedef, bases),
                            reductions=jnp.zeros((), jnp.int32))


def shardings(state_shapes: CompressionState, param_shardings: Any, compression: Compression,
              data_axes: Sequence[str], mesh: Mesh) -> CompressionState:
    """Error buffers split over the compressed axes (as the shards), each along the parameter's
    non-batch axes (tensor, stage); Q replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def error(shape, sharding):
        if shape is None:
            return None
        spec = rules_lib.spec_without(sharding.spec, data_axes)
        return NamedSharding(mesh, PartitionSpec(rules_lib.spec_entry(compression.axes), *spec))

    return CompressionState(
        error=jax.tree.map(error, state_shapes.error, param_shardings, is_leaf=lambda x: x is None),
        basis=jax.tree.map(lambda _: replicated, state_shapes.basis),
        reductions=replicated,
    )


def _orthonormal(p: jax.Array) -> jax.Array:
    """The columns of each stacked (rows, rank) matrix made orthonormal by Gram-Schmidt: a few
    elementwise passes for a small rank, where a QR factorization is a solver call per matrix."""
    columns = []
    for i in range(p.shape[-1]):
        column = p[..., i]
        for done in columns:
            column = column - jnp.sum(column * done, axis=-1, keepdims=True) * done
        columns.append(column / (jnp.linalg.norm(column, axis=-1, keepdims=True) + 1e-8))
    return jnp.stack(columns, axis=-1)


def _powersgd(m: jax.Array, q: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the reduced low-rank gradient, this shard's left-out part, the new Q) of one stacked
    (..., rows, cols) shard gradient `m` (error already added)."""
    p = _orthonormal(jax.lax.psum(m @ q, axes))
    own_q = jnp.swapaxes(m, -1, -2) @ p
    q_new = jax.lax.psum(own_q, axes)
    own = p @ jnp.swapaxes(own_q, -1, -2)  # this shard's projection p p^T m: they sum to p q_new^T
    return p @ jnp.swapaxes(q_new, -1, -2), m - own, q_new


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 values and a float32 scale per block (the last axis): x ~ values * scale."""
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def _int8(m: jax.Array, axes: tuple[str, ...], shards: int) -> tuple[jax.Array, jax.Array]:
    """(the reduced gradient, this shard's left-out part) of one shard gradient `m` (error added)."""
    flat = m.reshape(-1)
    per_chunk = -(-flat.size // (shards * INT8_BLOCK)) * INT8_BLOCK
    padded = jnp.pad(flat, (0, per_chunk * shards - flat.size)).reshape(shards, per_chunk // INT8_BLOCK, INT8_BLOCK)
    values, scale = _quantize(padded)
    left_out = padded - values * scale
    # Chunk c of every shard goes to shard c, which sums them in float32.
    values = jax.lax.all_to_all(values, axes, 0, 0, tiled=True)
    scale = jax.lax.all_to_all(scale, axes, 0, 0, tiled=True)
    chunk = jnp.sum(values.astype(jnp.float32) * scale, axis=0)
    chunk_values, chunk_scale = _quantize(chunk)
    # The requantized sum's rounding is fed back by the shard that owns the chunk.
    left_out = left_out.at[jax.lax.axis_index(axes)].add(chunk - chunk_values * chunk_scale)
    gathered = (jax.lax.all_gather(chunk_values, axes).astype(jnp.float32) * jax.lax.all_gather(chunk_scale, axes))
    reduced = gathered.reshape(-1)[:flat.size].reshape(m.shape)
    return reduced, left_out.reshape(-1)[:flat.size].reshape(m.shape)


def reduce(grads: Any, state: CompressionState, plans: Any, compression: Compression, mesh: Mesh,
           data_axes: tuple[str, ...], param_shardings: Any) -> tuple[Any, CompressionState]:
    """The sum over shards of `grads` ((shards, *param) per leaf, the shards over `data_axes` in
    order), each reduced as `plans` say, in `param_shardings`; and the new state.

    The data-parallel axes not compressed are summed exactly first. The first `compression.start`
    reductions are exact throughout (the state left as it is, but for its count).
    """
    def compressed(grads, state):
        return _reduce(grads, state, plans, compression, mesh, data_axes, param_shardings)

    def exact(grads, state):
        return jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g.sum(0), s), grads, param_shardings), state

    if compression.start:
        grads, state = jax.lax.cond(state.reductions < compression.start, exact, compressed, grads, state)
    else:
        grads, state = compressed(grads, state)
    return grads, state.replace(reductions=state.reductions + 1)


def _reduce(grads: Any, state: CompressionState, plans: Any, compression: Compression, mesh: Mesh,
            data_axes: tuple[str, ...], param_shardings: Any) -> tuple[Any, CompressionState]:
    """`reduce` once compression has started."""
    axes = compression.axes
    sizes = [mesh.shape[axis] for axis in data_axes]
    exact = tuple(i for i, axis in enumerate(data_axes) if axis not in axes)
    shards = rules_lib.axes_size(mesh, axes)

    def over_compressed_axes(g: jax.Array, sharding: NamedSharding) -> jax.Array:
        g = g.reshape(*sizes, *g.shape[1:]).sum(exact).reshape(shards, *g.shape[1:])
        rest = rules_lib.spec_without(sharding.spec, data_axes)
        return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, PartitionSpec(rules_lib.spec_entry(axes), *rest)))

    grads = jax.tree.map(over_compressed_axes, grads, param_shardings)
    leaves, treedef = jax.tree.flatten(plans, is_leaf=_is_leaf_plan)
    flat_grads = treedef.flatten_up_to(grads)
    flat_errors = treedef.flatten_up_to(state.error)
    flat_bases = treedef.flatten_up_to(state.basis)
    flat_shardings = treedef.flatten_up_to(param_shardings)
    reduced, errors, bases = [], [], []
    for leaf, g, error, basis, sharding in zip(leaves, flat_grads, flat_errors, flat_bases, flat_shardings):
        if error is None:
            reduced.append(jax.lax.with_sharding_constraint(g.sum(0), sharding))
            errors.append(None)
            bases.append(None)
            continue
        total, error, basis = _compressed(g + error, basis, leaf, compression, mesh, sharding, data_axes)
        reduced.append(total)
        errors.append(error)
        bases.append(basis)
    new_state = state.replace(error=jax.tree.unflatten(treedef, errors), basis=jax.tree.unflatten(treedef, bases))
    return jax.tree.unflatten(treedef, reduced), new_state


def _compressed(m: jax.Array, basis: jax.Array | None, leaf: LeafPlan, compression: Compression, mesh: Mesh,
                sharding: NamedSharding, data_axes: tuple[str, ...]):
    """(reduced gradient in `sharding`, new error, new basis) of one compressed leaf."""
    axes = compression.axes
    shard_spec = PartitionSpec(rules_lib.spec_entry(axes))
    if leaf.method == "powersgd":
        stacked, rows, cols = leaf.matrix

        def body(m, q):
            total, error, q = _powersgd(m[0].reshape(*stacked, rows, cols), q, axes)
            return total.reshape(leaf.shape), error.reshape(1, *leaf.shape), q

        # Manual over the compressed axes only: the partitioner still splits the rest (tensor).
        total, error, basis = jax.shard_map(
            body, mesh=mesh, in_specs=(shard_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), shard_spec, PartitionSpec()), axis_names=set(axes), check_vma=False,
        )(m, basis)
    else:
        # Manual over every axis: each device quantizes its own slice of the parameter.
        param_spec = rules_lib.padded_spec(rules_lib.spec_without(sharding.spec, data_axes), len(leaf.shape))
        error_spec = PartitionSpec(rules_lib.spec_entry(axes), *param_spec)
        shards = rules_lib.axes_size(mesh, axes)

        def body(m):
            total, error = _int8(m[0], axes, shards)
            return total, error[None]

        total, error = jax.shard_map(
            body, mesh=mesh, in_specs=(error_spec,), out_specs=(param_spec, error_spec), check_vma=False,
        )(m)
    return jax.lax.with_sharding_constraint(total, sharding), error, basis


def bytes_sent(plans: Any, compression: Compression) -> tuple[int, int]:
    """(bytes of the whole gradient in float32, bytes the compression sends for it), per shard: the
    payloads, before any algorithm's factor (a ring all-reduce moves about twice)."""
    exact = compressed = 0
    for leaf in jax.tree.leaves(plans, is_leaf=_is_leaf_plan):
        size = math.prod(leaf.shape)
        exact += 4 * size
        if leaf.method == "int8":
            compressed += size + 4 * -(-size // INT8_BLOCK)
        elif leaf.method == "powersgd":
            stacked, rows, cols = leaf.matrix
            compressed += 4 * math.prod(stacked) * (rows + cols) * compression.rank
        else:
            compressed += 4 * size
    return exact, compressed



@dataclasses.dataclass(frozen=True)
class Reducer:
    """A compressed reduction for one model on one mesh: `reducer(shares, state, param_shardings)`
    sums each batch shard's gradient share ((shards, *param) over `data_axes`) into the parameters'
    shardings and returns the new `CompressionState`."""

    compression: Compression
    plans: Any
    mesh: Mesh
    data_axes: tuple[str, ...]

    def init(self) -> CompressionState:
        """The state before the first step (run under jit with `state_shardings`)."""
        return init(self.plans, self.compression, rules_lib.axes_size(self.mesh, self.compression.axes))

    def state_shardings(self, param_shardings: Any) -> CompressionState:
        return shardings(jax.eval_shape(self.init), param_shardings, self.compression, self.data_axes, self.mesh)

    def __call__(self, shares: Any, state: CompressionState, param_shardings: Any) -> tuple[Any, CompressionState]:
        return reduce(shares, state, self.plans, self.compression, self.mesh, self.data_axes, param_shardings)


def reducer(abstract_params: Any, names: Any, roles: Any, compression: Compression, mesh: Mesh,
            data_axes: tuple[str, ...]) -> Reducer | None:
    """The `Reducer` for these parameters, or None for method none. Raises ValueError where
    `compression.axes` are not among the data-parallel axes."""
    if compression.method == "none":
        return None
    if compression.method not in METHODS:
        raise ValueError(f"gradient compression {compression.method!r}: use one of {METHODS}")
    outside = [axis for axis in compression.axes if axis not in data_axes]
    if outside or not compression.axes:
        raise ValueError(f"gradient compression over mesh axes {list(compression.axes)}: the gradients are reduced "
                         f"over the data-parallel axes {list(data_axes)}; name one or more of those")
    ordered = tuple(axis for axis in data_axes if axis in compression.axes)
    compression = dataclasses.replace(compression, axes=ordered)
    return Reducer(compression, leaf_plans(abstract_params, names, roles, compression), mesh, data_axes)
