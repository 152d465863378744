"""Multi-head latent attention (DeepSeek-V2 and V3): keys and values made from one small latent of
each token, and a part of every head apart for the position.

Each token's `kv_rank`-wide latent (normed) is projected up to every head's key part without
position (`model.head_dim` wide) and its value (`value_dim`); beside it, the token gives one
`rope_dim`-wide key part, rotated by RoPE and shared by every head. Queries are projected the same
two parts per head, through a `q_rank`-wide latent of their own (normed) or straight from the
token. A head's logits are its two parts' dot products summed, scaled by 1/sqrt(head_dim +
rope_dim). The KV cache of sampling holds the latents and the shared rotated parts only: kv_rank +
rope_dim numbers a token, against 2 x heads x head_dim for multi-head attention. Its projections
run in the compute dtype (`precision.fp8` leaves them out, as it does a mixture's experts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxdist.config import Section
from jaxdist.models.layers import norm
from jaxdist.models.layers.attention import KVCache, attention_impl, rms_normed, rope, rope_frequencies
from jaxdist.models.layers.common import HEADS, NORMAL, RESIDUAL, cast, param
from jaxdist.parallel import context, roles
from jaxdist.parallel.rules import constrain

if TYPE_CHECKING:
    from jaxdist.models.gpt.config import GPTConfig, ImplConfig
    from jaxdist.models.layers.attention import Documents

# The logical name of the latents' width (replicated by every preset: it is small).
LATENT = "latent"


class LatentConfig(Section):
    """`model.latent`: multi-head latent attention in place of the q, k, v projections (`kv_rank: 0`:
    none). Each head's key part without position is `model.head_dim` wide."""

    kv_rank: int = Field(0, ge=0, description="the keys' and values' latent width (DeepSeek-V3: 512; 0: no latent "
                                              "attention)")
    q_rank: int | None = Field(None, gt=0, description="the queries' latent width (DeepSeek-V3: 1536); null: queries "
                                                       "projected straight from the token")
    rope_dim: int = Field(64, gt=0, description="the RoPE part of every query and key head, the key's shared by all "
                                                "heads (DeepSeek-V3: 64)")
    value_dim: int | None = Field(None, gt=0, description="each head's value width (DeepSeek-V3: 128); null: "
                                                          "model.head_dim")
    norm_eps: float = Field(1e-6, gt=0, description="the latents' RMSNorms' epsilon")


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention; `__call__(x, docs)` and `decode(x, cache, start)` as
    `Attention`'s (models/layers/attention.py), the cache holding latents (see the module's doc)."""

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False,
                 layer: int = 0):
        latent = cfg.latent
        d, h, plain, rope_dim, value = cfg.d_model, cfg.heads, cfg.head_width, latent.rope_dim, cfg.value_width
        self.plain, self.rope_dim, self.value, self.kv_rank = plain, rope_dim, value, latent.kv_rank
        self.eps, self.plus_one = latent.norm_eps, cfg.norm_plus_one
        self.implementation = impl.attention
        self.freqs = tuple(rope_frequencies(rope_dim, cfg.rope_base, cfg.rope_scaling).tolist())
        self.scores = context.Scores((cfg.attention_scale_dim or plain + rope_dim) ** -0.5, cfg.attention_softcap)
        if latent.q_rank:
            self.q_down = param(rngs, NORMAL, (d, latent.q_rank), ("embed", LATENT), param_dtype)
            self.q_norm = param(rngs, norm.scale_init(cfg), (latent.q_rank,), (LATENT,), param_dtype, roles.NORM)
            self.q_up = param(rngs, NORMAL, (latent.q_rank, h, plain + rope_dim), (LATENT, "heads", "head_dim"),
                              param_dtype)
        else:
            self.q = param(rngs, NORMAL, (d, h, plain + rope_dim), ("embed", "heads", "head_dim"), param_dtype)
        self.kv_down = param(rngs, NORMAL, (d, latent.kv_rank + rope_dim), ("embed", LATENT), param_dtype)
        self.kv_norm = param(rngs, norm.scale_init(cfg), (latent.kv_rank,), (LATENT,), param_dtype, roles.NORM)
        self.kv_up = param(rngs, NORMAL, (latent.kv_rank, h, plain + value), (LATENT, "heads", "head_dim"),
                           param_dtype)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.out = param(rngs, out_init, (h, value, d), ("heads", "head_dim", "embed"), param_dtype)

    def __call__(self, x: jax.Array, docs: Documents | None = None) -> jax.Array:
        positions = jnp.arange(x.shape[1]) if docs is None else docs.positions
        q = self._queries(x, positions)
        k, v = self._keys_values(*self._latents(x, positions))
        # Values padded to the keys' width, which attention kernels ask of them; the pad's outputs are dropped.
        padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - self.value)))
        y = context.attention(q, k, padded, None if docs is None else docs.mask,
                              attention_impl(self.implementation, x.dtype), HEADS, HEADS, None, self.scores)
        return self._output(y[..., :self.value])

    def decode(self, x: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """`Attention.decode`'s step: the new positions' latents and shared rotated key parts written
        into `cache` (keys: (batch, length, 1, kv_rank), values: (batch, length, 1, rope_dim)), every
        cached one expanded to keys and values."""
        positions = start + jnp.arange(x.shape[1])
        latent, shared = self._latents(x, positions)
        latents, shareds = (jax.lax.dynamic_update_slice(held, new[:, :, None].astype(held.dtype), (0, start, 0, 0))
                            for held, new in ((cache.keys, latent), (cache.values, shared)))
        k, v = self._keys_values(latents[:, :, 0].astype(x.dtype), shareds[:, :, 0].astype(x.dtype))
        visible = context.causal_visible(positions[:, None], jnp.arange(k.shape[1])[None, :], None)
        padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k.shape[-1] - self.value)))
        y = context.dot_product(self._queries(x, positions), k, padded, visible[None, None], "xla", self.scores)
        return self._output(y[..., :self.value]), KVCache(latents, shareds)

    def _queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """(batch, length, heads, head_dim + rope_dim): each head's part without position, then its rotated part."""
        if hasattr(self, "q_down"):
            latent = jnp.einsum("btd,dr->btr", x, cast(self.q_down[...], x.dtype))
            latent = self._normed(latent, self.q_norm)
            q = jnp.einsum("btr,rhk->bthk", latent, cast(self.q_up[...], x.dtype))
        else:
            q = jnp.einsum("btd,dhk->bthk", x, cast(self.q[...], x.dtype))
        q = constrain(q, HEADS)
        return jnp.concatenate([q[..., :self.plain], rope(q[..., self.plain:], positions, self.freqs)], axis=-1)

    def _latents(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each token's normed latent (batch, length, kv_rank) and its rotated shared key part
        (batch, length, rope_dim)."""
        both = jnp.einsum("btd,dr->btr", x, cast(self.kv_down[...], x.dtype))
        latent = self._normed(both[..., :self.kv_rank], self.kv_norm)
        shared = rope(both[..., None, self.kv_rank:], positions, self.freqs)[..., 0, :]
        return latent, shared

    def _keys_values(self, latent: jax.Array, shared: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (batch, length, heads, head_dim + rope_dim) and values (..., value_dim) of the latents."""
        up = constrain(jnp.einsum("btr,rhk->bthk", latent, cast(self.kv_up[...], latent.dtype)), HEADS)
        shared = jnp.broadcast_to(shared[:, :, None], (*up.shape[:3], self.rope_dim))
        return constrain(jnp.concatenate([up[..., :self.plain], shared], axis=-1), HEADS), up[..., self.plain:]

    def _normed(self, latent: jax.Array, scale: nnx.Param) -> jax.Array:
        """`latent` RMS-normed over its width in float32, then scaled."""
        return rms_normed(latent[..., None, :], norm.scale_of(scale[...], self.plus_one), self.eps)[..., 0, :]

    def _output(self, y: jax.Array) -> jax.Array:
        out = jnp.einsum("bthk,hkd->btd", constrain(y, HEADS), cast(self.out[...], y.dtype))
        return constrain(out, RESIDUAL)
