"""Compute-dtype copies of the parameters, kept between steps.

A matmul weight stored in float32 is cast to the compute dtype at every use: each step reads it
whole and writes its copy before the forward pass can start (docs/performance.md). Kept between
steps instead, the copy is written by the optimizer's update, which
reads the new weight anyway. The values the model sees and the gradients the optimizer gets are
those of the cast: `read_copies` hands the model the copy and its gradient back to the parameter.

Under FSDP the copies are split like their parameters. `Gather` (train.fsdp_gather=per_step)
makes each copy whole before the model reads it, so the forward's all-gather is the one the
backward reads too (PyTorch FSDP2's reshard_after_forward=False); without it XLA gathers each
weight at each use, in the forward and again in the backward unless it keeps the first.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def compute_copies(params: Any, picks: Callable[[tuple], bool], dtype: jnp.dtype) -> Any:
    """`params` cast to `dtype` where `picks(path)` (and the dtype differs); None elsewhere."""

    def copy(path, leaf):
        return leaf.astype(dtype) if picks(path) and leaf.dtype != dtype else None

    return jax.tree_util.tree_map_with_path(copy, params)


@dataclasses.dataclass(frozen=True)
class Gather:
    """Shardings the copies are gathered to before the model reads them (`whole`: split along no
    `fsdp` axis), and the copies' own (`split`), which their gradients are reduce-scattered back to.
    `split` None: the gradients keep whatever layout the caller gives them (per-shard gradients
    reduced later, train/accumulate.py's per_step path)."""

    whole: Any
    split: Any = None


def read_copies(params: Any, copies: Any, gather: Gather | None = None) -> Any:
    """`params` with every copied leaf read from its copy (gathered whole first, with `gather`);
    gradients still reach `params`, in their dtype."""
    if copies is None:
        return params
    if gather is not None:
        copies = _gathered(copies, gather)
    return jax.tree.map(lambda param, copy: param if copy is None else _read_copy(param, copy), params, copies)


def _gathered(copies: Any, gather: Gather) -> Any:
    if gather.split is None:
        # The transpose of a sharding constraint constrains the gradient alike: whole, as unreduced
        # per-shard gradients are.
        return jax.tree.map(jax.lax.with_sharding_constraint, copies, gather.whole)
    return jax.tree.map(_gather, copies, gather.whole, gather.split)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(copy: jax.Array, whole: Any, split: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(copy, whole)


def _gather_fwd(copy, whole, split):
    return _gather(copy, whole, split), None


def _gather_bwd(whole, split, _, grad):
    # Straight to the copy's split layout: a reduce-scatter, not an all-reduce then a slice.
    return (jax.lax.with_sharding_constraint(grad, split),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@jax.custom_vjp
def _read_copy(param: jax.Array, copy: jax.Array) -> jax.Array:
    return copy


def _read_copy_fwd(param, copy):
    return copy, jnp.zeros((), param.dtype)  # the residual carries the parameter's dtype


def _read_copy_bwd(dtype_carrier, grad):
    return grad.astype(dtype_carrier.dtype), None


_read_copy.defvjp(_read_copy_fwd, _read_copy_bwd)
