"""Causal self-attention: multi-head or grouped-query, RoPE (Llama 3's scaling), q and k normed per
head (Qwen3's), a sliding window (Mistral's), packed documents (attention within each, positions
restarting), and the KV cache for sampling (no longer than the window, where there is one)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.models.layers import norm
from jaxdist.models.layers.common import HEADS, KV_HEADS, NORMAL, RESIDUAL, ZEROS, cast, param, project
from jaxdist.parallel import context, roles
from jaxdist.parallel.rules import constrain

if TYPE_CHECKING:
    from jaxdist.models.gpt.config import GPTConfig, ImplConfig, RopeScaling


class Documents(NamedTuple):
    """Where the documents of packed rows lie: `mask` (batch, 1, length, length), true where a query
    may attend to a key (the same document, not later), each token's `positions` (batch, length)
    within its document, and `counted` (batch, length), true for a document's tokens (false for
    padding). None where every row is one stream (attention causal, positions 0, 1, ...)."""

    mask: jax.Array
    positions: jax.Array
    counted: jax.Array


def documents(segments: jax.Array, positions: jax.Array) -> Documents:
    """The `Documents` of packed rows: `segments` (batch, length) numbers each token's document
    within its row (0: padding), `positions` its place in that document."""
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same = segments[:, :, None] == segments[:, None, :]
    return Documents((same & causal)[:, None], positions, segments > 0)


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE's angular frequency for each pair of a head's dims (float32), as Hugging Face computes them."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    if scaling is None or scaling.kind == "none":
        return freqs.astype(np.float32)
    if scaling.kind == "linear":
        return (freqs / np.float32(scaling.factor)).astype(np.float32)
    wavelengths = 2 * np.pi / freqs
    slowed = np.where(wavelengths > scaling.original_length / scaling.low_freq_factor, freqs / scaling.factor, freqs)
    blend = ((scaling.original_length / wavelengths - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor))
    medium = ((wavelengths >= scaling.original_length / scaling.high_freq_factor)
              & (wavelengths <= scaling.original_length / scaling.low_freq_factor))
    return np.where(medium, (1 - blend) * slowed / scaling.factor + blend * slowed, slowed).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, freqs: Sequence[float]) -> jax.Array:
    """Rotary position embedding over the last dim of (batch, length, heads, head_dim), its two
    halves rotated as pairs (Hugging Face's `rotate_half`); `positions` (length,) or (batch,
    length); `freqs` from `rope_frequencies`."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(freqs, jnp.float32)
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]  # over the heads
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class KVCache(NamedTuple):
    """The keys and values of the positions sampled so far, (batch, length, kv heads, head_dim) per
    layer (a leading layer axis where the layers are stacked), for sampling one token at a time.
    Under a sliding window shorter than what is sampled, `length` is the window's and the cache a
    ring: position p is held at p mod length, over the position a window before it."""

    keys: jax.Array
    values: jax.Array


class Attention(nnx.Module):
    """Causal self-attention. With as many key/value heads as query heads, q, k and v are stacked on
    a leading axis (`qkv`): each is a contiguous slice, so the three projections need no activation
    transposes or concatenations. With fewer (grouped-query attention), `q` and the stacked `kv`."""

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False,
                 layer: int = 0):
        head_dim = cfg.head_width
        self.grouped = cfg.key_value_heads != cfg.heads
        self.fp8 = fp8
        self.window = cfg.layer_window(layer)
        # A tuple, not an array: static to NNX, no variable of the model. Windowed layers may have a
        # RoPE base of their own (model.local_rope_base), unscaled.
        local_base = cfg.local_rope_base if self.window is not None else None
        base, scaling = (cfg.rope_base, cfg.rope_scaling) if local_base is None else (local_base, None)
        self.freqs = tuple(rope_frequencies(head_dim, base, scaling).tolist()) if cfg.positions == "rope" else None
        self.implementation = impl.attention
        self.scores = context.Scores(None if cfg.attention_scale_dim is None else cfg.attention_scale_dim ** -0.5,
                                     cfg.attention_softcap)
        d, h, kv = cfg.d_model, cfg.heads, cfg.key_value_heads
        if self.grouped:
            self.q = param(rngs, NORMAL, (d, h, head_dim), ("embed", "heads", "head_dim"), param_dtype)
            self.kv = param(rngs, NORMAL, (2, d, kv, head_dim), ("qkv", "embed", "kv_heads", "head_dim"), param_dtype)
        else:
            self.qkv = param(rngs, NORMAL, (3, d, h, head_dim), ("qkv", "embed", "heads", "head_dim"), param_dtype)
        if cfg.biases != "none":
            if self.grouped:
                self.q_bias = param(rngs, ZEROS, (h, head_dim), ("heads", "head_dim"), param_dtype, roles.BIAS)
                self.kv_bias = param(rngs, ZEROS, (2, kv, head_dim), ("qkv", "kv_heads", "head_dim"), param_dtype,
                                      roles.BIAS)
            else:
                self.qkv_bias = param(rngs, ZEROS, (3, h, head_dim), ("qkv", "heads", "head_dim"), param_dtype,
                                       roles.BIAS)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.out = param(rngs, out_init, (h, head_dim, d), ("heads", "head_dim", "embed"), param_dtype)
        if cfg.biases == "all":
            self.out_bias = param(rngs, ZEROS, (d,), ("embed",), param_dtype, roles.BIAS)
        if cfg.qk_norm:
            self.norm_eps, self.norm_plus_one = cfg.norm_eps, cfg.norm_plus_one
            self.q_norm, self.k_norm = (param(rngs, norm.scale_init(cfg), (head_dim,), ("head_dim",),
                                              param_dtype, roles.NORM) for _ in range(2))

    def __call__(self, x: jax.Array, docs: Documents | None = None) -> jax.Array:
        q, k, v = self._project(x)
        if self.freqs is not None:
            positions = jnp.arange(x.shape[1]) if docs is None else docs.positions
            q, k = rope(q, positions, self.freqs), rope(k, positions, self.freqs)
        y = context.attention(q, k, v, None if docs is None else docs.mask,
                              attention_impl(self.implementation, x.dtype), HEADS, KV_HEADS if self.grouped else HEADS,
                              self.window, self.scores)
        return self._output(y)

    def decode(self, x: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Attention of `x` (batch, new, embed), at positions `start`, `start + 1`, ..., over the keys
        and values of every earlier position in `cache` and its own, which it writes into the cache."""
        q, k, v = self._project(x)
        positions = start + jnp.arange(x.shape[1])
        if self.freqs is not None:
            q, k = rope(q, positions, self.freqs), rope(k, positions, self.freqs)
        # The cache laid out as the keys and values are: its heads split as the model's.
        names = KV_HEADS if self.grouped else HEADS
        if self.window is not None and cache.keys.shape[1] <= self.window:
            return self._decode_in_window(q, k, v, cache, start, names)
        keys = constrain(jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, start, 0, 0)), names)
        values = constrain(jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), (0, start, 0, 0)),
                           names)
        # A cache longer than the window (if any): the window as a mask.
        visible = context.causal_visible(positions[:, None], jnp.arange(keys.shape[1])[None, :], self.window)
        y = context.dot_product(q, keys.astype(q.dtype), values.astype(q.dtype), visible[None, None], "xla",
                                self.scores)
        return self._output(y), KVCache(keys, values)

    def _decode_in_window(self, q, k, v, cache: KVCache, start: jax.Array, names) -> tuple[jax.Array, KVCache]:
        """`decode` with a ring cache (`KVCache`) of at most the window's length: the new positions
        attend to the cache as it was and to each other, then the last of them overwrite their slots."""
        size, new = cache.keys.shape[1], q.shape[1]
        slots = jnp.arange(size)
        # The position each slot holds: the last one before `start` that falls on it (negative: none yet).
        held = start - 1 - (start - 1 - slots) % size
        key_positions = jnp.concatenate([held, start + jnp.arange(new)])
        visible = context.causal_visible((start + jnp.arange(new))[:, None], key_positions[None, :], self.window)
        visible = (visible & (key_positions >= 0)[None, :])[None, None]
        keys = jnp.concatenate([cache.keys.astype(q.dtype), k], axis=1)
        values = jnp.concatenate([cache.values.astype(q.dtype), v], axis=1)
        y = context.dot_product(q, keys, values, visible, "xla", self.scores)
        kept = min(new, size)  # the last `size` new positions are the ones a later query can see
        written = (start + new - kept + jnp.arange(kept)) % size
        keys = constrain(cache.keys.at[:, written].set(k[:, new - kept:].astype(cache.keys.dtype)), names)
        values = constrain(cache.values.at[:, written].set(v[:, new - kept:].astype(cache.values.dtype)), names)
        return self._output(y), KVCache(keys, values)

    def _output(self, y: jax.Array) -> jax.Array:
        """The heads' outputs (batch, length, heads, head_dim) projected back to the residual stream."""
        out = project(self.fp8, "bthk,hkd->btd", constrain(y, HEADS), cast(self.out[...], y.dtype))
        if hasattr(self, "out_bias"):
            out = out + cast(self.out_bias[...], y.dtype)
        return constrain(out, RESIDUAL)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = self._projections(x)
        if hasattr(self, "q_norm"):
            q, k = (rms_normed(x, norm.scale_of(scale[...], self.norm_plus_one), self.norm_eps)
                    for x, scale in ((q, self.q_norm), (k, self.k_norm)))
        return q, k, v

    def _projections(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        uses = _fan_out(x, 3)  # x itself, three times: their gradients are summed in an order XLA folds
        if not self.grouped:
            qkv = cast(self.qkv[...], x.dtype)
            bias = cast(self.qkv_bias[...], x.dtype) if hasattr(self, "qkv_bias") else None
            return tuple(constrain(_biased(project(self.fp8, "btd,dhk->bthk", uses[i], qkv[i]), bias, i), HEADS)
                         for i in range(3))
        kv = cast(self.kv[...], x.dtype)
        q_bias = cast(self.q_bias[...], x.dtype) if hasattr(self, "q_bias") else None
        kv_bias = cast(self.kv_bias[...], x.dtype) if hasattr(self, "kv_bias") else None
        q = project(self.fp8, "btd,dhk->bthk", uses[0], cast(self.q[...], x.dtype))
        q = constrain(q if q_bias is None else q + q_bias, HEADS)
        k, v = (constrain(_biased(project(self.fp8, "btd,dhk->bthk", uses[1 + i], kv[i]), kv_bias, i), KV_HEADS)
                for i in range(2))
        return q, k, v


def rms_normed(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Each head of x (batch, length, heads, head_dim) RMS-normed over its dims in float32, then scaled."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _biased(x: jax.Array, stacked_bias: jax.Array | None, i: int) -> jax.Array:
    return x if stacked_bias is None else x + stacked_bias[i]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fan_out(x: jax.Array, count: int) -> tuple[jax.Array, ...]:
    """`count` uses of `x` whose gradients are summed each new one first (see `_fan_out_bwd`)."""
    return (x,) * count


def _fan_out_fwd(x, count):
    return (x,) * count, None


def _fan_out_bwd(count, _, cotangents):
    # Autodiff sums a value's gradients running sum first, from the last use back. Summed in that
    # order but each new gradient first (the same values), XLA folds every sum of matmul outputs
    # into a matmul (cuBLAS's beta); in autodiff's form it left the last sum as a pass of its own
    # over batch x length x embed.
    total = cotangents[-1]
    for cotangent in reversed(cotangents[:-1]):
        total = cotangent + total
    return (total,)


_fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def attention_impl(attention: str, dtype) -> str | None:
    """The attention kernel `model.impl.attention` asks for (auto: cuDNN's for 16-bit compute on GPU)."""
    if attention != "auto":
        return attention
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and dtype in (jnp.bfloat16, jnp.float16) else "xla"
