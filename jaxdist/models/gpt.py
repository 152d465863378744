"""A GPT decoder in flax NNX that names its dimensions and nothing else.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `head_dim`, `mlp`,
`layers`, `length`); every large activation is constrained by logical names. Where they land on
the mesh is decided by the rules (jaxdist.parallel.rules), never here.

The blocks are created stacked (a leading `layers` axis) and run as a `lax.scan` (fast compile),
or split into a block per layer and run unrolled (often faster on GPU), with optional remat.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import Field, field_validator, model_validator

from jaxdist.config import MODEL_NAME, Config, ModelSection, ParamSize, PipelineConfig, Section
from jaxdist.config.base import positive_or_auto
from jaxdist.errors import UserError
from jaxdist.kernels import fused_norm, gelu_matmul, softmax_grad
from jaxdist.models import dtypes as dtypes_lib
from jaxdist.models import fp8 as fp8_lib
from jaxdist.models.cross_entropy import fused_linear_cross_entropy
from jaxdist.models.loss import Loss
from jaxdist.models.registry import ModelEntry, register
from jaxdist.parallel import context, roles
from jaxdist.parallel import pipeline as pipeline_lib
from jaxdist.parallel.rules import constrain

class ImplConfig(Section):
    """How the model runs: layer stacking, recomputation, kernels and loss chunking.

    None of these changes the math beyond float rounding; they trade compile time, memory and speed
    (docs/performance.md says what each was measured to do). For a kernel switch, auto uses it where
    it is possible and known to be faster, xla never, the explicit value always (or errors).
    """

    scan_layers: bool = Field(
        True, description="true: layers stacked in a lax.scan (fast compile, needed by pipelines); false: unrolled")
    remat: Literal["none", "mlp", "full", "dots"] = Field(
        "none", description="recomputed in the backward: nothing, the MLP activation, whole blocks, or all but matmuls")
    attention: Literal["auto", "xla", "cudnn"] = Field("auto", description="attention implementation")
    norm_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="residual add + norm as one Pallas kernel (kernels/fused_norm.py)")
    gelu_grad_impl: Literal["auto", "xla", "cublaslt"] = Field(
        "auto", description="GELU's gradient in the MLP backward matmul's cuBLASLt epilogue (kernels/gelu_matmul.py)")
    logits_dtype: Literal["float32", "compute"] = Field(
        "float32", description="dtype of the output projection's logits (the softmax is float32 either way)")
    loss_chunk: int = Field(
        0, ge=0, description="> 0: the loss projects this many positions at a time, never the full logits")
    loss_impl: Literal["auto", "xla", "pallas"] = Field(
        "auto", description="the chunked loss's softmax and gradient as one Pallas kernel (needs loss_chunk > 0)")

    @model_validator(mode="after")
    def _combinations(self) -> ImplConfig:
        if self.loss_impl == "pallas" and not self.loss_chunk:
            raise ValueError("model.impl.loss_impl=pallas needs model.impl.loss_chunk > 0 (the kernel runs inside the "
                             "chunked loss)")
        return self


class RopeScaling(Section):
    """Llama 3's stretch of RoPE's low frequencies to a longer context (`rope_type: llama3` in a
    Hugging Face config): wavelengths above `original_length / low_freq_factor` are divided by
    `factor`, those below `original_length / high_freq_factor` kept, those between blended."""

    kind: Literal["none", "llama3"] = Field("none", description="none: plain RoPE; llama3: Llama 3.1's scaling")
    factor: float = Field(8.0, gt=0, description="how much the low frequencies are slowed")
    low_freq_factor: float = Field(1.0, gt=0, description="original_length / this: the longest kept wavelength's bound")
    high_freq_factor: float = Field(4.0, gt=0, description="original_length / this: the shortest scaled wavelength's bound")
    original_length: int = Field(8192, gt=0, description="the context length the model was first trained at")

    @model_validator(mode="after")
    def _factors(self) -> RopeScaling:
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"model.rope_scaling.low_freq_factor={self.low_freq_factor}")
        return self


class GPTConfig(ModelSection):
    """The `model:` section of a decoder-only transformer language model (`model.name=gpt`).

    The same decoder covers GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings) and,
    as `model.name=llama`, the Llama family (RMSNorm, RoPE, SwiGLU, grouped-query attention).
    """

    name: Literal["gpt"] = Field("gpt", description=MODEL_NAME)
    vocab: int | Literal["auto"] = Field(
        256, description="vocabulary size; auto: the configured data's (resolved before the model is built)")
    d_model: int = Field(256, gt=0, description="width of the residual stream")
    layers: int = Field(4, gt=0, description="number of transformer blocks")
    heads: int = Field(8, gt=0, description="attention heads (must divide d_model)")
    kv_heads: int | None = Field(
        None, gt=0, description="key and value heads, shared by groups of query heads (must divide heads); "
                                "null: as many as heads")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width as a multiple of d_model")
    mlp_hidden: int | None = Field(None, gt=0, description="MLP hidden width; null: int(d_model x mlp_ratio)")
    seq_len: int = Field(256, gt=0, description="tokens per sequence")
    max_positions: int | None = Field(
        None, gt=0, description="rows of the learned position table (at least seq_len); null: seq_len")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="normalization layer")
    norm_eps: float = Field(1e-5, gt=0, description="the norms' epsilon")
    positions: Literal["learned", "rope"] = Field("learned", description="position encoding")
    rope_base: float = Field(10000.0, gt=0, description="RoPE's base period (rope_theta)")
    rope_scaling: RopeScaling = Field(RopeScaling(), description="RoPE's frequency scaling")
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation (gelu: its tanh form)")
    biases: Literal["none", "qkv", "all"] = Field(
        "none", description="additive biases: none; on the q, k and v projections (Qwen2); on every projection (GPT-2)")
    tied_embeddings: bool = Field(False, description="the output projection reuses the token embedding")
    init_from: str | None = Field(
        None, description="hf:FOLDER: a fresh run starts from a Hugging Face model's weights, and takes the "
                          "architecture from its config.json")
    impl: ImplConfig = Field(ImplConfig(), description="how the model runs (the same math)")

    @field_validator("vocab", mode="before")
    @classmethod
    def _vocab(cls, value: Any) -> Any:
        return positive_or_auto("model.vocab", value, "ids", "vocabulary")

    @model_validator(mode="after")
    def _shapes(self) -> GPTConfig:
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        if self.heads % self.key_value_heads:
            raise ValueError(f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}")
        if self.positions == "learned" and self.position_rows < self.seq_len:
            raise ValueError(f"model.max_positions={self.max_positions} is below model.seq_len={self.seq_len}: the "
                             f"learned position table needs a row per position")
        if self.init_from is not None and not self.init_from.startswith("hf:"):
            raise ValueError(f"model.init_from={self.init_from!r}: write hf:FOLDER, a Hugging Face model folder")
        if self.positions == "rope" and (self.d_model // self.heads) % 2:
            raise ValueError("model.positions=rope needs an even head dimension (d_model / heads)")
        if self.mlp_dim < 1:
            raise ValueError(f"model.mlp_ratio={self.mlp_ratio} makes the MLP's hidden width int(model.d_model x "
                             f"model.mlp_ratio) = {self.mlp_dim}; it needs at least 1: model.mlp_ratio >= "
                             f"1/{self.d_model}")
        chunk = self.impl.loss_chunk
        if chunk and self.seq_len % chunk:
            raise ValueError(f"model.impl.loss_chunk={chunk} does not divide model.seq_len={self.seq_len}; use a "
                             f"divisor of {self.seq_len}, or 0 for the unchunked loss")
        if self.impl.gelu_grad_impl == "cublaslt" and self.activation != "gelu":
            raise ValueError(f"model.impl.gelu_grad_impl=cublaslt needs model.activation=gelu, not {self.activation}")
        return self

    @property
    def mlp_dim(self) -> int:
        return self.mlp_hidden or int(self.d_model * self.mlp_ratio)

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def position_rows(self) -> int:
        return self.max_positions or self.seq_len

    @property
    def layer_stack(self) -> int:
        return self.layers

    @property
    def stacked_layers(self) -> bool:
        return self.impl.scan_layers

    @property
    def wants_native_kernels(self) -> bool:
        """The MLP's GELU gradient in cuBLASLt's epilogue (`model.impl.gelu_grad_impl` auto or cublaslt, with GELU)."""
        return self.impl.gelu_grad_impl != "xla" and self.activation == "gelu"

    @property
    def tokens_per_example(self) -> int:
        return self.seq_len

    def param_sizes(self) -> list[ParamSize]:
        # Not the stacked `layers`: that dim exists only with model.impl.scan_layers, and the layout's pipeline
        # check checks model.layers against mesh.stage.
        sizes = [
            ParamSize("embed", "model.d_model", self.d_model, self.d_model, "the embedding dimension of every weight"),
            ParamSize("heads", "model.heads", self.heads, self.heads, "the attention heads of every attention weight"),
            ParamSize("mlp", "model.mlp_hidden", self.mlp_hidden, self.mlp_dim, "the MLP's hidden width")
            if self.mlp_hidden else ParamSize("mlp", "model.mlp_ratio", self.mlp_ratio, self.mlp_dim,
                                              "the MLP's hidden width int(model.d_model x model.mlp_ratio)"),
            ParamSize("head_dim", "model.d_model", self.d_model, self.d_model // self.heads,
                      "the head dimension model.d_model / model.heads"),
        ]
        if self.vocab != "auto":
            sizes.append(ParamSize("vocab", "model.vocab", self.vocab, self.vocab,
                                   "the vocabulary of the token embedding and the output head"))
        if self.key_value_heads != self.heads:
            sizes.append(ParamSize("kv_heads", "model.kv_heads", self.kv_heads, self.key_value_heads,
                                   "the key and value heads of grouped-query attention"))
        if self.positions == "learned":
            key, value = ("model.max_positions", self.max_positions) if self.max_positions else ("model.seq_len", self.seq_len)
            sizes.append(ParamSize("length", key, value, self.position_rows,
                                   "the positions of the learned position embedding"))
        return sizes

    def summary(self) -> dict[str, Any]:
        return {"d": self.d_model, "layers": self.layers, "seq": self.seq_len}


Names = tuple[str | None, ...]


class Documents(NamedTuple):
    """Where the documents of packed rows lie: `mask` (batch, 1, length, length), true where a query
    may attend to a key (the same document, not later), and each token's `positions` (batch,
    length) within its document. None where every row is one stream (attention causal, positions
    0, 1, ...)."""

    mask: jax.Array
    positions: jax.Array


def documents(segments: jax.Array, positions: jax.Array) -> Documents:
    """The `Documents` of packed rows: `segments` (batch, length) numbers each token's document
    within its row (0: padding), `positions` its place in that document."""
    length = segments.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same = segments[:, :, None] == segments[:, None, :]
    return Documents((same & causal)[:, None], positions)

# The residual stream between blocks (and through the norms) names its length axis `seq`, apart
# from `length` inside attention and the MLP: rules may split `seq` over `tensor` (sequence
# parallelism), so that norms and residual adds are not repeated on every tensor-parallel device
# (off in the presets: measured slower at tensor=4 on H200, see
# benchmarks/reports/2026-11-27-stage4-unrolled-tensor4.md).
RESIDUAL: Names = ("batch", "seq", "embed")
HEADS: Names = ("batch", "length", "heads", "head_dim")  # q, k, v and attention's output

_normal = nnx.initializers.normal(0.02)
_zeros = nnx.initializers.zeros_init()

# The parameters the model reads only cast to the compute dtype: the blocks' matmul weights. A copy
# kept in that dtype can stand in for each (train/copies.py). Not the embedding (its rows are
# added to the positions before the cast), the norms, or the head (the chunked loss sums its
# gradient in float32 and hands it back in the head's own dtype).
COMPUTE_DTYPE_PARAMS = frozenset({"qkv", "q", "kv", "out", "up", "gate", "down"})


def read_in_compute_dtype(path: tuple) -> bool:
    """Whether the parameter at this pytree path is one of `COMPUTE_DTYPE_PARAMS`."""
    return bool(path) and getattr(path[-1], "key", None) in COMPUTE_DTYPE_PARAMS


def _param(rngs: nnx.Rngs, init, shape: Sequence[int], names: Names, dtype, role: str = roles.WEIGHT) -> nnx.Param:
    """A parameter with its logical names and its role (parallel/roles.py: what decay, trust ratios
    and compression go by)."""
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=names, role=role)


def _cast(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype) if x.dtype != dtype else x


def _at_least_float32(x: jax.Array) -> jax.Array:
    return _cast(x, jnp.promote_types(x.dtype, jnp.float32))


class Norm(nnx.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale), computed in float32.

    `add(x, delta)` also adds a residual branch first; on GPU both run as fused Pallas kernels
    (`model.impl.norm_impl`, kernels/fused_norm.py), elsewhere as plain XLA.
    """

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs):
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.impl = impl.norm_impl
        self.scale = _param(rngs, nnx.initializers.ones_init(), (cfg.d_model,), ("embed",), param_dtype, roles.NORM)
        if cfg.norm == "layernorm":
            self.bias = _param(rngs, nnx.initializers.zeros_init(), (cfg.d_model,), ("embed",), param_dtype, roles.NORM)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._fused(x):
            return fused_norm.norm(x, self.scale[...], self._bias(), rms=self.kind == "rmsnorm", eps=self.eps, names=RESIDUAL)
        return self._xla(x)

    def add(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """`(x + delta, norm(x + delta))`: the next residual and its normed rows (`delta` None: no add)."""
        if delta is None:
            return x, self(x)
        if self._fused(x):
            return fused_norm.add_norm(x, delta, self.scale[...], self._bias(), rms=self.kind == "rmsnorm",
                                       eps=self.eps, names=RESIDUAL)
        total = x + delta
        return total, self._xla(total)

    def _fused(self, x: jax.Array) -> bool:
        return fused_norm.use_kernel(self.impl, x, RESIDUAL)

    def _bias(self) -> jax.Array | None:
        return self.bias[...] if self.kind == "layernorm" else None

    def _xla(self, x: jax.Array) -> jax.Array:
        y = fused_norm.normalize(x.astype(jnp.float32), self.kind == "rmsnorm", self.eps)[0] * self.scale[...]
        if self.kind == "layernorm":
            y = y + self.bias[...]
        return y.astype(x.dtype)


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE's angular frequency for each pair of a head's dims (float32), as Hugging Face computes them."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    if scaling is None or scaling.kind == "none":
        return freqs.astype(np.float32)
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


KV_HEADS: Names = ("batch", "length", "kv_heads", "head_dim")  # grouped-query attention's k and v


class KVCache(NamedTuple):
    """The keys and values of the positions sampled so far, (batch, length, kv heads, head_dim) per
    layer (a leading layer axis where the layers are stacked), for sampling one token at a time."""

    keys: jax.Array
    values: jax.Array


class Attention(nnx.Module):
    """Causal self-attention. With as many key/value heads as query heads, q, k and v are stacked on
    a leading axis (`qkv`): each is a contiguous slice, so the three projections need no activation
    transposes or concatenations. With fewer (grouped-query attention), `q` and the stacked `kv`."""

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False):
        head_dim = cfg.d_model // cfg.heads
        self.grouped = cfg.key_value_heads != cfg.heads
        self.fp8 = fp8
        # A tuple, not an array: static to NNX, no variable of the model.
        self.freqs = (tuple(rope_frequencies(head_dim, cfg.rope_base, cfg.rope_scaling).tolist())
                      if cfg.positions == "rope" else None)
        self.implementation = impl.attention
        d, h, kv = cfg.d_model, cfg.heads, cfg.key_value_heads
        if self.grouped:
            self.q = _param(rngs, _normal, (d, h, head_dim), ("embed", "heads", "head_dim"), param_dtype)
            self.kv = _param(rngs, _normal, (2, d, kv, head_dim), ("qkv", "embed", "kv_heads", "head_dim"), param_dtype)
        else:
            self.qkv = _param(rngs, _normal, (3, d, h, head_dim), ("qkv", "embed", "heads", "head_dim"), param_dtype)
        if cfg.biases != "none":
            if self.grouped:
                self.q_bias = _param(rngs, _zeros, (h, head_dim), ("heads", "head_dim"), param_dtype, roles.BIAS)
                self.kv_bias = _param(rngs, _zeros, (2, kv, head_dim), ("qkv", "kv_heads", "head_dim"), param_dtype,
                                      roles.BIAS)
            else:
                self.qkv_bias = _param(rngs, _zeros, (3, h, head_dim), ("qkv", "heads", "head_dim"), param_dtype,
                                       roles.BIAS)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.out = _param(rngs, out_init, (h, head_dim, d), ("heads", "head_dim", "embed"), param_dtype)
        if cfg.biases == "all":
            self.out_bias = _param(rngs, _zeros, (d,), ("embed",), param_dtype, roles.BIAS)

    def __call__(self, x: jax.Array, docs: Documents | None = None) -> jax.Array:
        q, k, v = self._project(x)
        if self.freqs is not None:
            positions = jnp.arange(x.shape[1]) if docs is None else docs.positions
            q, k = rope(q, positions, self.freqs), rope(k, positions, self.freqs)
        y = context.attention(q, k, v, None if docs is None else docs.mask,
                              _attention_impl(self.implementation, x.dtype), HEADS, KV_HEADS if self.grouped else HEADS)
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
        keys = constrain(jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, start, 0, 0)), names)
        values = constrain(jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), (0, start, 0, 0)),
                           names)
        visible = (jnp.arange(keys.shape[1])[None, :] <= positions[:, None])[None, None]
        y = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=visible,
                                         implementation="xla")
        return self._output(y), KVCache(keys, values)

    def _output(self, y: jax.Array) -> jax.Array:
        """The heads' outputs (batch, length, heads, head_dim) projected back to the residual stream."""
        out = _project(self.fp8, "bthk,hkd->btd", constrain(y, HEADS), _cast(self.out[...], y.dtype))
        if hasattr(self, "out_bias"):
            out = out + _cast(self.out_bias[...], y.dtype)
        return constrain(out, RESIDUAL)

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        uses = _fan_out(x, 3)  # x itself, three times: their gradients are summed in an order XLA folds
        if not self.grouped:
            qkv = _cast(self.qkv[...], x.dtype)
            bias = _cast(self.qkv_bias[...], x.dtype) if hasattr(self, "qkv_bias") else None
            return tuple(constrain(_biased(_project(self.fp8, "btd,dhk->bthk", uses[i], qkv[i]), bias, i), HEADS)
                         for i in range(3))
        kv = _cast(self.kv[...], x.dtype)
        q_bias = _cast(self.q_bias[...], x.dtype) if hasattr(self, "q_bias") else None
        kv_bias = _cast(self.kv_bias[...], x.dtype) if hasattr(self, "kv_bias") else None
        q = _project(self.fp8, "btd,dhk->bthk", uses[0], _cast(self.q[...], x.dtype))
        q = constrain(q if q_bias is None else q + q_bias, HEADS)
        k, v = (constrain(_biased(_project(self.fp8, "btd,dhk->bthk", uses[1 + i], kv[i]), kv_bias, i), KV_HEADS)
                for i in range(2))
        return q, k, v


def _project(fp8: bool, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection `einsum(spec, x, w)`, through FP8 GEMMs with `fp8` (models/fp8.py)."""
    return fp8_lib.einsum(spec, x, w) if fp8 else jnp.einsum(spec, x, w)


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


def _attention_impl(attention: str, dtype) -> str | None:
    if attention != "auto":
        return attention
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and dtype in (jnp.bfloat16, jnp.float16) else "xla"


class Mlp(nnx.Module):
    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False):
        self.activation = cfg.activation
        self.fp8 = fp8
        self.gelu_grad_impl = impl.gelu_grad_impl
        self.recompute_activation = impl.remat == "mlp"
        self.up = _param(rngs, _normal, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), param_dtype)
        if cfg.activation == "swiglu":
            self.gate = _param(rngs, _normal, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), param_dtype)
        down_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.down = _param(rngs, down_init, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"), param_dtype)
        if cfg.biases == "all":
            self.up_bias = _param(rngs, _zeros, (cfg.mlp_dim,), ("mlp",), param_dtype, roles.BIAS)
            if cfg.activation == "swiglu":
                self.gate_bias = _param(rngs, _zeros, (cfg.mlp_dim,), ("mlp",), param_dtype, roles.BIAS)
            self.down_bias = _param(rngs, _zeros, (cfg.d_model,), ("embed",), param_dtype, roles.BIAS)

    def __call__(self, x: jax.Array) -> jax.Array:
        up = _project(self.fp8, "btd,dm->btm", x, _cast(self.up[...], x.dtype))
        h = constrain(self._bias("up_bias", up), ("batch", "length", "mlp"))
        gate = None
        if self.activation == "swiglu":
            gate = _project(self.fp8, "btd,dm->btm", x, _cast(self.gate[...], x.dtype))
            gate = constrain(self._bias("gate_bias", gate), ("batch", "length", "mlp"))
        project = self._activate_and_project
        if self.recompute_activation:
            # The backward pass recomputes the activation from the saved up-projection (one
            # elementwise pass) instead of keeping its output: batch x length x mlp per layer less.
            project = jax.checkpoint(project, policy=jax.checkpoint_policies.nothing_saveable)
        return constrain(self._bias("down_bias", project(h, gate, _cast(self.down[...], x.dtype))), RESIDUAL)

    def _bias(self, name: str, y: jax.Array) -> jax.Array:
        return y + _cast(getattr(self, name)[...], y.dtype) if hasattr(self, name) else y

    def _activate_and_project(self, h: jax.Array, gate: jax.Array | None, down: jax.Array) -> jax.Array:
        if self.activation == "swiglu":
            return _project(self.fp8, "btm,md->btd", jax.nn.silu(gate) * h, down)
        if self.fp8:  # the FP8 GEMM in place of the cuBLASLt GELU-gradient kernel's bfloat16 one
            # Kept for the backward, `h` would let XLA's GEMM rewriter fold the GELU into the up
            # projection's FP8 GEMM (a GELU_AUX epilogue), which cuBLASLt has no FP8 kernel for:
            # "No candidates could be compiled". The barrier keeps the two apart.
            return fp8_lib.einsum("btm,md->btd", gelu_matmul.gelu(jax.lax.optimization_barrier(h)), down)
        # Its backward keeps `h` and gelu(h), not the formula's tanh, and on GPU puts GELU's
        # gradient into the matmul's epilogue (kernels/gelu_matmul.py).
        return gelu_matmul.gelu_project(h, down, kernel=gelu_matmul.use_kernel(self.gelu_grad_impl, h, down))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    `__call__(x, delta, docs)` takes the residual and the previous block's pending MLP output and returns
    the same pair: each residual add happens inside the norm that follows it (one fused kernel on
    GPU), so the last block's add is done by the caller's final norm. `delta` None: nothing pending;
    `docs`: the packed documents' attention mask and positions (None: one stream per row).
    """

    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False):
        self.norm1 = Norm(cfg, impl, param_dtype, rngs)
        self.attn = Attention(cfg, impl, param_dtype, rngs, fp8)
        self.norm2 = Norm(cfg, impl, param_dtype, rngs)
        self.mlp = Mlp(cfg, impl, param_dtype, rngs, fp8)

    def __call__(self, x: jax.Array, delta: jax.Array | None = None,
                 docs: Documents | None = None) -> tuple[jax.Array, jax.Array]:
        x, h = self.norm1.add(x, delta)
        x, h = self.norm2.add(x, self.attn(h, docs))
        return x, self.mlp(h)


def _decode_block(block: Block, x: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
    """One block's step of sampling: `x` the new positions' residual (see `Attention.decode`)."""
    attended, cache = block.attn.decode(block.norm1(x), cache, start)
    x = x + attended
    return x + block.mlp(block.norm2(x)), cache


def _unstack(stacked: Block, create_block) -> list[Block]:
    """The layers of a stacked block as blocks of their own (built as `create_block()` builds one)."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(create_block)
    # The stacks whole first: XLA would otherwise fuse each layer's slice into the random draw that
    # makes the stack, one copy of the draw's code per layer, and compile for that much longer.
    graphdef, values = nnx.graphdef(abstract), jax.lax.optimization_barrier(nnx.to_pure_dict(nnx.state(stacked)))
    layers = jax.tree.leaves(values)[0].shape[0]
    blocks = []
    for i in range(layers):
        state = nnx.state(abstract)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda stack: stack[i], values))
        blocks.append(nnx.merge(graphdef, state))
    return blocks


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    """Decoder-only transformer; `__call__(tokens)` gives logits (batch, length, vocab).

    `features(tokens)` gives the two inputs of that last projection separately, for losses that
    never form the full logits (models/cross_entropy.py).

    `cfg` is the architecture, `impl` how it runs (scanned or unrolled layers, remat, kernels, loss
    chunks; default `cfg.impl`). With `pipeline` settings and a stage axis in the mesh, the blocks run
    as a pipeline. With `fp8`, the attention and MLP projections run as FP8 GEMMs (models/fp8.py).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        impl: ImplConfig | None = None,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        pipeline: PipelineConfig | None = None,
        fp8: bool = False,
    ):
        impl = cfg.impl if impl is None else impl
        self.cfg = cfg
        self.impl = impl
        self.compute_dtype = compute_dtype
        self.pipeline = pipeline
        self.embed = _param(rngs, _normal, (cfg.vocab, cfg.d_model), ("vocab", "embed"), param_dtype, roles.EMBEDDING)
        if cfg.positions == "learned":
            self.positions = _param(rngs, _normal, (cfg.position_rows, cfg.d_model), ("length", "embed"), param_dtype,
                                    roles.EMBEDDING)

        # The blocks are drawn stacked either way: one random draw per kind of parameter, not one per
        # layer, keeps the init program small (each draw compiles to kernels of its own: see
        # docs/performance.md), and a scanned and an unrolled model start from the same values.
        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, impl, param_dtype, rngs, fp8)

        stacked = stacked_blocks(rngs)
        # Unrolled, separate parameters per layer: each layer's gradient is complete as soon as its
        # backward is done, so its reduction can overlap the rest of the backward pass.
        self.blocks = stacked if impl.scan_layers else nnx.List(
            _unstack(stacked, lambda: Block(cfg, impl, param_dtype, nnx.Rngs(0), fp8)))
        self.final_norm = Norm(cfg, impl, param_dtype, rngs)
        if not cfg.tied_embeddings:
            self.head = _param(rngs, _normal, (cfg.d_model, cfg.vocab), ("embed", "vocab"), param_dtype)

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return self._logits(*self.features(tokens, segments, positions))

    def features(self, tokens: jax.Array, segments: jax.Array | None = None,
                 positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The output projection's two inputs: the final normed hidden states (batch, length, embed)
        in the compute dtype, and `head_weights()`. Packed rows pass `segments` (each token's
        document in its row, 0 for padding) and `positions` (its place in the document): attention
        stays within a document and positions restart with each."""
        x = self._embed(tokens)
        docs = None if segments is None else documents(segments, positions)
        if self.cfg.positions == "learned":
            if docs is None:
                x = x + _at_least_float32(self.positions[: tokens.shape[1]])
            else:
                x = x + jnp.take(_at_least_float32(self.positions[...]), docs.positions, axis=0)
        x = constrain(_cast(x, self.compute_dtype), RESIDUAL)
        x, delta = self._run_blocks(x, docs, () if segments is None else (segments, positions))
        return self.final_norm.add(x, delta)[1], self.head_weights()

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty `KVCache` for `batch` rows of up to `length` positions, in the compute dtype."""
        cfg = self.cfg
        shape = (cfg.layers, batch, length, cfg.key_value_heads, cfg.d_model // cfg.heads)
        zeros = jnp.zeros(shape, self.compute_dtype)
        return KVCache(zeros, zeros)

    def decode(self, tokens: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Logits (batch, new, vocab) of `tokens` (batch, new) at positions `start`, `start + 1`, ...,
        attending to the earlier positions held in `cache` (from `init_cache`), and the cache with
        these positions' keys and values added. Sampling calls it once on the prompt, then once per
        token: each position's keys and values are computed once, not again for every later token."""
        x = self._embed(tokens)
        if self.cfg.positions == "learned":
            rows = jax.lax.dynamic_slice_in_dim(self.positions[...], start, tokens.shape[1])
            x = x + _at_least_float32(rows)
        x = constrain(_cast(x, self.compute_dtype), RESIDUAL)
        if self.impl.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)

            def body(x, layer):
                state, keys, values = layer
                x, layer_cache = _decode_block(nnx.merge(graphdef, state), x, KVCache(keys, values), start)
                return x, layer_cache

            x, cache = jax.lax.scan(body, x, (stacked, cache.keys, cache.values))
            cache = KVCache(*cache)
        else:
            layers = []
            for i, block in enumerate(self.blocks):
                x, layer_cache = _decode_block(block, x, KVCache(cache.keys[i], cache.values[i]), start)
                layers.append(layer_cache)
            cache = KVCache(jnp.stack([c.keys for c in layers]), jnp.stack([c.values for c in layers]))
        return self._logits(self.final_norm(x), self.head_weights()), cache

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """The tokens' embedding rows, in float32 at least."""
        # The table gathered to the activations' layout first (its `embed` dim whole, as FSDP
        # gathers any weight before use): left split, the lookup's output would have to be split
        # along `embed` and the batch at once, which XLA can only do by replicating it when the
        # batch is split over more axes than the table's (the stage axis, outside a pipeline).
        # Looked up in float32 at least: the lookup's gradient adds every occurrence of a token into
        # its row, which in bfloat16 parameters would lose most of a frequent token's sum.
        return jnp.take(constrain(_at_least_float32(self.embed[...]), ("vocab", "embed")), tokens, axis=0)

    def _logits(self, hidden: jax.Array, head: jax.Array) -> jax.Array:
        logits = jnp.einsum("btd,dv->btv", hidden, _cast(head, hidden.dtype), preferred_element_type=self.logits_dtype)
        return constrain(logits, ("batch", "length", "vocab"))

    def head_weights(self) -> jax.Array:
        """The output projection (embed, vocab) in the parameter dtype; the embedding transposed when tied."""
        return self.embed[...].T if self.cfg.tied_embeddings else self.head[...]

    @property
    def logits_dtype(self):
        """The dtype the output projection writes its logits in (`model.impl.logits_dtype`)."""
        return jnp.float32 if self.impl.logits_dtype == "float32" else self.compute_dtype

    def _run_blocks(self, x: jax.Array, docs: Documents | None,
                    packed: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array | None]:
        """The residual after the blocks and the last block's output not yet added to it. `packed`:
        packed rows' (segments, positions), from which the stacked layers make their `docs` (in a
        pipeline, each microbatch's travel with it through the stages), or ()."""
        if not self.impl.scan_layers:
            delta = None
            run_block = self._block_runner(nnx.graphdef(self.blocks[0]))
            for block in self.blocks:
                x, delta = run_block(nnx.state(block), x, delta, docs)
            return x, delta
        graphdef, stacked = nnx.split(self.blocks)
        run = functools.partial(self._run_layers, graphdef)
        riders = tuple(pipeline_lib.Rider(part, ("batch", "length")) for part in packed)
        return pipeline_lib.run_layers(run, stacked, x, self.pipeline, RESIDUAL, riders), None

    def _run_layers(self, graphdef: nnx.GraphDef, x: jax.Array, layers, *, unroll: bool,
                    riders: tuple[jax.Array, ...] = ()) -> jax.Array:
        """Runs the blocks in order: `layers` stacked (one nnx.State, a leading layer dim) scanned, or
        with `unroll` (a pipeline stage's layers) a sequence of per-layer states, one call each,
        passing the pending residual add as unrolled blocks do. `riders`: packed rows' (segments,
        positions), or ()."""
        docs = documents(*riders) if riders else None
        if unroll:
            run_block = self._block_runner(graphdef)
            delta = None
            for layer_state in layers:
                x, delta = run_block(layer_state, x, delta, docs)
            return x + delta

        def body(carry, layer_state):
            x, delta = nnx.merge(graphdef, layer_state)(carry, None, docs)
            return x + delta, None

        x, _ = jax.lax.scan(self._remat(body), x, layers)
        return x

    def _block_runner(self, graphdef: nnx.GraphDef):
        """`run(block_state, x, pending_delta, docs)`: one block's call, a jit of its own. The blocks have
        the same shapes, so it is traced (and its kernels lowered) once, or twice with the first
        block's missing residual, not once per layer; XLA inlines the calls: the program is the same."""
        def block(state: nnx.State, carry: jax.Array, pending: jax.Array | None,
                  docs: Documents | None) -> tuple[jax.Array, jax.Array]:
            return nnx.merge(graphdef, state)(carry, pending, docs)

        return jax.jit(self._remat(block))  # named: profiles and HLO read jit(block)

    def _remat(self, fn):
        if self.impl.remat in ("none", "mlp"):
            return fn
        return jax.checkpoint(fn, policy=_REMAT_POLICIES[self.impl.remat], prevent_cse=not self.impl.scan_layers)


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token as the PaLM paper counts them for model FLOPs utilization
    (Chowdhery et al. 2022, appendix B): 6N + 12 x layers x d x seq, N the parameters of the matmuls
    (the output projection included; 12 x layers x d^2 + vocab x d for a GELU MLP of 4 x d without
    grouped-query attention), 12 x layers x d x seq for attention."""
    m = cfg.model
    attention = m.d_model**2 * (2 + 2 * m.key_value_heads / m.heads)
    mlp = (3 if m.activation == "swiglu" else 2) * m.d_model * m.mlp_dim
    matmul_params = int(m.layers * (attention + mlp)) + m.vocab * m.d_model
    return 6 * matmul_params + 12 * m.layers * m.d_model * m.seq_len


def random_tokens(cfg: Config, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """`rows` sequences of uniform random tokens: inputs and the same tokens shifted by one as targets."""
    tokens = rng.integers(0, cfg.model.vocab, (rows, cfg.model.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss(model: nnx.Module, batch: dict[str, jax.Array]) -> Loss:
    """Next-token cross-entropy (float32), summed over the targets that count, and their number.

    Every target counts 1, or its sequence's `weights` (eval batches: 0 marks padding). Packed rows
    (`segments` and `positions`, data.packing) are scored per document, their padding (segment 0)
    left out. A model with `model.impl.loss_chunk` > 0 is scored chunk by chunk, never forming the
    full logits.
    """
    impl = getattr(model, "impl", None)
    chunk = getattr(impl, "loss_chunk", 0)
    segments, positions = batch.get("segments"), batch.get("positions")
    weights = batch.get("weights")
    if segments is not None:  # per token: real tokens of real rows
        weights = (segments > 0).astype(jnp.float32) * (1.0 if weights is None else weights[:, None])
    targets = batch["targets"]
    if weights is None:
        weight = jnp.float32(targets.size)
    else:
        weight = weights.sum() if weights.ndim == 2 else weights.sum() * targets.shape[1]
    if chunk:
        hidden, head = model.features(batch["inputs"], segments, positions)
        total = fused_linear_cross_entropy(hidden, head, targets, weights, chunk=chunk,
                                           logits_dtype=model.logits_dtype, impl=impl.loss_impl)
        return Loss(total, weight)
    logits = model(batch["inputs"], segments, positions).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if weights is not None:
        losses = losses * jnp.broadcast_to(weights if weights.ndim == 2 else weights[:, None], losses.shape)
    return Loss(losses.sum(), weight)


def create(cfg: Config) -> Callable[[nnx.Rngs], nnx.Module]:
    """The GPT `cfg` describes, as a function of its random keys (in the configured dtypes)."""
    if cfg.model.vocab == "auto":
        raise UserError("model.vocab=auto is not resolved; pass the config through "
                        "jaxdist.data.loader.resolve_model, or set model.vocab to a number")
    dtypes = dtypes_lib.policy(cfg.precision)
    return lambda rngs: GPT(cfg.model, rngs=rngs, param_dtype=dtypes.param_dtype, compute_dtype=dtypes.compute_dtype,
                            pipeline=cfg.pipeline, fp8=dtypes.fp8)


ENTRY = register(ModelEntry(
    section=GPTConfig, create=create, loss=loss,
    flops_per_example=lambda cfg: flops_per_token(cfg) * cfg.model.seq_len,
    random_batch=random_tokens, batch_keys=("inputs", "targets"), read_in_compute_dtype=read_in_compute_dtype,
    samples_text=True,
    activations=(RESIDUAL, HEADS, KV_HEADS, gelu_matmul.PRE_NAMES, gelu_matmul.OUT_NAMES, softmax_grad.LOGITS,
                 ("vocab", "embed"), ("embed", "vocab"), ("batch", "embed", "vocab")),
))
