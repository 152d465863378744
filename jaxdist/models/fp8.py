"""FP8 matmuls (`precision.fp8`): e4m3 operands forward, the input's gradient from an e5m2 output
gradient, the weight's gradient in the compute dtype; each FP8 tensor scaled by its own current
absolute maximum.

`einsum(spec, x, w)` quantizes both operands to float8_e4m3fn, each divided by a float32 scale
that maps its largest magnitude onto the format's largest finite value (448), and contracts the
dequantized operands: XLA's GEMM rewriter turns a dot of (convert, times a scalar) operands into
one cuBLASLt FP8 GEMM on Hopper that applies the two scales in its epilogue, so nothing is
dequantized in memory. The backward quantizes the output's gradient to float8_e5m2 (more range,
less precision: 57,344) and contracts it with the FP8 weight the same way for the input's
gradient. The weight's gradient is the compute-dtype product of the input and the output gradient:
FP8 weight gradients (each a sum over every token of the batch, under one scale per tensor) trained
measurably worse, and on Hopper they need both operands transposed in FP8 (docs/performance.md).

The scaling is current, not delayed: each scale comes from the tensor it scales, in the same
step. That costs one max-reduction per operand but carries no amax history: nothing to checkpoint,
and no history to get wrong when a weight is used by several microbatches, pipeline iterations or
batch shards within one step. A non-finite value makes its scale non-finite, and with it the
matmul's output, so the step's non-finite guard still sees it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdist import runtime

FORWARD = jnp.float8_e4m3fn
GRADIENT = jnp.float8_e5m2


def supported(devices: list | None = None) -> bool:
    """Whether FP8 matmuls run on these devices (default: every local device): see `unavailable_reason`."""
    return unavailable_reason(devices) is None


def unavailable_reason(devices: list | None = None) -> str | None:
    """Why these devices (default: every local device) run no FP8 matmuls in this process, or None
    where they do: NVIDIA GPUs of compute capability 8.9 or above (Ada, Hopper and later), with XLA's
    Triton GEMMs off. On, XLA wraps each dot in a Triton fusion before its cuBLAS rewriter can make it
    an FP8 GEMM, and then folds the quantization away: the products run in the compute dtype."""
    devices = jax.local_devices() if devices is None else devices
    lacking = next((device for device in devices if not _has_fp8(device)), None)
    if not devices or lacking is not None:
        named = f"{lacking.device_kind} ({lacking.platform})" if lacking is not None else "no device"
        return f"{named} has no FP8 matmuls (they need an NVIDIA GPU of compute capability 8.9 or above)"
    if runtime.xla_flags().get(runtime.TRITON_GEMM, "true").lower() not in ("false", "0"):  # XLA's default: on
        return ("XLA's Triton GEMMs are on (XLA_FLAGS), which keep dots from becoming FP8 GEMMs: call "
                "jaxdist.gpu_defaults() before JAX starts, as the jaxdist command does")
    return None


def _has_fp8(device) -> bool:
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", None)
    if capability is None:  # ROCm reports none: its FP8 formats differ (fnuz), not taken
        return False
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return (major, minor) >= (8, 9)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`x` as `dtype` (an FP8 type) and its float32 scale: `x ~ quantized * scale`.

    The absolute maximum and the scale are float32 whatever `x`'s dtype, and the scale is the power
    of two at or above `amax / largest` (the format's largest value), never below the smallest
    normal number of `x`'s dtype: so the compute dtype holds it exactly. XLA's GEMM rewriter takes
    an FP8 GEMM's scale from the compute-dtype multiply of its dequantized operand (dequantized in
    float32 instead, the product was no FP8 GEMM or a slower one: docs/performance.md), and any
    other scale would round there (bfloat16) or, for a float16 gradient (1e-3 / 57,344 = 1.7e-8),
    flush to zero.
    """
    largest = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x).astype(jnp.float32))
    ratio = amax / largest
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa x 2^exponent, mantissa in [0.5, 1)
    power = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))  # exact, not exp2's
    scale = jnp.where(jnp.isfinite(ratio), jnp.maximum(power, jnp.float32(jnp.finfo(x.dtype).tiny)), ratio)
    scale = jnp.where(amax > 0, scale, jnp.float32(1.0))
    quantized = jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype)
    return quantized, scale


def dequantize(quantized: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`quantized * scale` in `dtype`, exactly (the scale is a power of two that `dtype` holds): the
    form XLA's GEMM rewriter folds into an FP8 GEMM."""
    return quantized.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, w)` through FP8 GEMMs; `x` and `w` in the same (compute) dtype, the
    result in it too."""
    return _einsum_fwd(spec, x, w)[0]


def _einsum_fwd(spec, x, w):
    if x.dtype != w.dtype:
        raise TypeError(f"fp8.einsum takes operands of one dtype, got {x.dtype} and {w.dtype}")
    x_q, x_scale = quantize(x, FORWARD)
    w_q, w_scale = quantize(w, FORWARD)
    out = jnp.einsum(spec, dequantize(x_q, x_scale, x.dtype), dequantize(w_q, w_scale, x.dtype))
    return out, (x, w_q, w_scale)


def _einsum_bwd(spec, residuals, d_out):
    x, w_q, w_scale = residuals
    w = dequantize(w_q, w_scale, d_out.dtype)
    g_q, g_scale = quantize(d_out, GRADIENT)
    _, to_x = jax.vjp(lambda x: jnp.einsum(spec, x, w), x)
    _, to_w = jax.vjp(lambda w: jnp.einsum(spec, x, w), w)
    return to_x(dequantize(g_q, g_scale, d_out.dtype))[0], to_w(d_out)[0]


einsum.defvjp(_einsum_fwd, _einsum_bwd)
