"""Context parallelism: each sequence split over mesh axes, through causal attention.

Rules that split the activations' `length` (inside attention and the MLP) and `seq` (the residual
stream) over mesh axes cut every sequence into contiguous chunks, one per device along those axes:

    rules: {preset: fsdp, activations: {batch: data, seq: fsdp, length: fsdp}}

The projections, the MLP, the norms and the loss then run on each device's chunk alone, the weights
still split over fsdp. Attention is where the chunks meet, in one of two ways:

- Heads exchanged (where each device's query and key/value heads divide by the chunk count, and no
  document mask is given): an all-to-all turns each device's (chunk, all its heads) into (the whole
  sequence, a share of its heads); plain causal attention runs on that (cuDNN's flash kernel on
  GPUs, every device the same work), and a second all-to-all turns the output back. Four
  all-to-alls per layer forward, each of one chunk's activations.
- Keys and values gathered (otherwise): one all-gather of each per layer (their gradients are
  reduce-scattered back), each device's queries attending to every key under a causal mask offset
  by where its chunk starts. The mask is an explicit array, which attention kernels read as a bias,
  and the first chunks have less to attend to than the last.

A sliding window (`model.sliding_window`) is the attention's own in the first way, and part of the
offset mask in the second.

Activation memory per device falls with the chunk, so sequences that do not fit one device fit
several.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.parallel import rules as rules_lib

# Attention's q, k, v and output: (batch, length, heads, head_dim).
_LENGTH, _HEADS = 1, 2


class Scores(NamedTuple):
    """How attention's logits are made of q . k: times `scale` (None: 1/sqrt(head_dim)), then capped
    softly at `softcap`, softcap x tanh(logit / softcap) (None: not; Gemma 2's)."""

    scale: float | None = None
    softcap: float | None = None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, implementation: str | None,
              names: tuple[str, ...], kv_names: tuple[str, ...], window: int | None = None,
              scores: Scores = Scores()) -> jax.Array:
    """Causal attention (`dot_product`) of q, k, v (batch, length, heads, head_dim; k and v may have
    fewer heads), with `mask` (batch, 1, length, length) further limiting what each query sees,
    `window` (if any) the tokens each sees, itself included, and the logits made as `scores` says.
    Where the active rules split `length` (the logical `names` of q, `kv_names` of k and v), over
    the devices' chunks."""
    active = rules_lib.sharded_activation(names)
    axes = () if active is None else rules_lib.spec_axes(active[1][_LENGTH])
    if not axes:
        return dot_product(q, k, v, mask, implementation, scores, is_causal=True, window=window)
    mesh, q_spec = active
    kv_spec = rules_lib.sharded_activation(kv_names)[1]
    chunks = rules_lib.axes_size(mesh, axes)
    if mask is None and all(_local_heads(x, spec, mesh) % chunks == 0 for x, spec in ((q, q_spec), (k, kv_spec))):
        return _heads_exchanged(q, k, v, implementation, mesh, axes, q_spec, kv_spec, window, scores)
    return _keys_gathered(q, k, v, mask, implementation, mesh, axes, q_spec, kv_spec, window, scores)


def dot_product(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, implementation: str | None,
                scores: Scores = Scores(), *, is_causal: bool = False, window: int | None = None) -> jax.Array:
    """`jax.nn.dot_product_attention` on one device's q, k, v, or, with a soft cap (which it lacks),
    the same math as XLA ops: the logits in float32, capped, masked, softmaxed."""
    if scores.softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scores.scale, is_causal=is_causal,
                                            implementation=implementation, local_window_size=_reach(window))
    batch, length, heads, dim = q.shape
    kv_heads = k.shape[_HEADS]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)  # query head h reads kv head h // group
    scale = dim ** -0.5 if scores.scale is None else scores.scale
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k, preferred_element_type=jnp.float32) * scale
    logits = scores.softcap * jnp.tanh(logits / scores.softcap)
    visible = jnp.ones(logits.shape[-2:], bool)
    if is_causal:
        visible = causal_visible(jnp.arange(length)[:, None], jnp.arange(k.shape[_LENGTH])[None, :], window)
    if mask is not None:
        visible = visible & mask[:, :, None]  # (batch, 1, 1, queries, keys): every head's
    probs = jax.nn.softmax(jnp.where(visible, logits, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v)
    return out.reshape(batch, length, heads, dim)


def causal_visible(query_positions: jax.Array, key_positions: jax.Array, window: int | None) -> jax.Array:
    """Where a query may see a key, given their positions (broadcast against each other): the key not
    later than the query and, under a sliding window, fewer than `window` tokens before it."""
    visible = query_positions >= key_positions
    if window is not None:
        visible &= query_positions - key_positions < window
    return visible


def _reach(window: int | None) -> tuple[int, int] | None:
    """`local_window_size` of a causal window of `window` tokens: that many less one back, none ahead."""
    return None if window is None else (window - 1, 0)


def _local_heads(x: jax.Array, spec: PartitionSpec, mesh) -> int:
    return x.shape[_HEADS] // rules_lib.axes_size(mesh, rules_lib.spec_axes(spec[_HEADS]))


def _heads_exchanged(q, k, v, implementation, mesh, axes, q_spec, kv_spec, window, scores):
    def chunk_attention(q, k, v):
        # (rows, chunk, heads, head_dim) -> (rows, whole length, heads / chunks, head_dim): the
        # chunks concatenated in device order along the axes, which is their order in the sequence.
        def whole_sequence(x):
            return jax.lax.all_to_all(x, axes, _HEADS, _LENGTH, tiled=True)

        out = dot_product(whole_sequence(q), whole_sequence(k), whole_sequence(v), None, implementation, scores,
                          is_causal=True, window=window)
        return jax.lax.all_to_all(out, axes, _LENGTH, _HEADS, tiled=True)

    # Manual over the whole mesh: each device on its own rows and heads throughout.
    return jax.shard_map(chunk_attention, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v)


def _keys_gathered(q, k, v, mask, implementation, mesh, axes, q_spec, kv_spec, window, scores):
    rows = PartitionSpec(q_spec[0], None, q_spec[_LENGTH], None)  # the mask's batch and query rows

    def chunk_attention(q, k, v, *mask):
        keys = jax.lax.all_gather(k, axes, axis=_LENGTH, tiled=True)
        values = jax.lax.all_gather(v, axes, axis=_LENGTH, tiled=True)
        length = q.shape[_LENGTH]
        start = jax.lax.axis_index(axes) * length
        queries, keys_at = (start + jnp.arange(length))[:, None], jnp.arange(keys.shape[_LENGTH])[None, :]
        causal = causal_visible(queries, keys_at, window)
        visible = causal[None, None] if not mask else mask[0] & causal
        return dot_product(q, keys, values, visible, implementation, scores)

    # Each device on its own rows, chunk and heads (manual over the whole mesh): only the keys and
    # values cross devices, along the length axes.
    return jax.shard_map(
        chunk_attention, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + ((rows,) if mask is not None else ()),
        out_specs=q_spec, check_vma=False,
    )(q, k, v, *(() if mask is None else (mask,)))
