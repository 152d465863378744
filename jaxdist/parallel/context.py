"""Context parallelism: each sequence split over mesh axes, through causal attention.

Rules that split the activations' `length` (inside attention and the MLP) and `seq` (the residual
stream) over mesh axes cut every sequence into contiguous chunks, one per device along those axes:

    rules: {preset: fsdp, activations: {batch: data, seq: fsdp, length: fsdp}}

The projections, the MLP, the norms and the loss then run on each device's chunk alone, the weights
still split over fsdp. Attention is where the chunks meet: `attention` gathers the keys and values
along those axes (one all-gather of each per layer; in the backward pass their gradients are
reduce-scattered back) and attends each device's queries to every key, masked causally from where
the device's chunk starts. Activation memory per device falls with the chunk, so sequences that do
not fit one device fit several; the gathered keys and values of one layer are the one full-length
tensor. The split is contiguous, so the causal mask leaves the first chunks less work than the
last (no load balancing yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.parallel import rules as rules_lib

# Attention's q, k, v and output: (batch, length, heads, head_dim).
_LENGTH = 1


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, implementation: str | None,
              names: tuple[str, ...], kv_names: tuple[str, ...]) -> jax.Array:
    """Causal `jax.nn.dot_product_attention` of q, k, v (batch, length, heads, head_dim; k and v
    may have fewer heads), with `mask` (batch, 1, length, length) further limiting what each query
    sees. Where the active rules split `length` (the logical `names` of q, `kv_names` of k and v),
    over the devices' chunks."""
    active = rules_lib.sharded_activation(names)
    axes = () if active is None else rules_lib.spec_axes(active[1][_LENGTH])
    if not axes:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    mesh, q_spec = active
    kv_spec = rules_lib.sharded_activation(kv_names)[1]
    rows = PartitionSpec(q_spec[0], None, q_spec[_LENGTH], None)  # the mask's batch and query rows

    def chunk_attention(q, k, v, *mask):
        keys = jax.lax.all_gather(k, axes, axis=_LENGTH, tiled=True)
        values = jax.lax.all_gather(v, axes, axis=_LENGTH, tiled=True)
        length = q.shape[_LENGTH]
        start = jax.lax.axis_index(axes) * length
        causal = (start + jnp.arange(length))[:, None] >= jnp.arange(keys.shape[_LENGTH])[None, :]
        visible = causal[None, None] if not mask else mask[0] & causal
        return jax.nn.dot_product_attention(q, keys, values, mask=visible, implementation=implementation)

    # Each device on its own rows, chunk and heads (manual over the whole mesh): only the keys and
    # values cross devices, along the length axes.
    return jax.shard_map(
        chunk_attention, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + ((rows,) if mask is not None else ()),
        out_specs=q_spec, check_vma=False,
    )(q, k, v, *(() if mask is None else (mask,)))
