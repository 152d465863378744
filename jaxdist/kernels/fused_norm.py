"""Residual add + LayerNorm/RMSNorm as one GPU kernel forward and one backward (Pallas).

A pre-norm block computes `x = x + delta` and then `norm(x)`. XLA splits that, and its backward,
into several fusions with a float32 intermediate: on the 406M GPT (one H100) the norms and residual
adds took about 470 us per layer, against about 180 us to move their bytes once. Here:

- forward: reads `x` and `delta` once; writes the sum (the next residual) and the normed output;
- backward: reads the sum, the gradient of the normed output and the gradient that reaches the sum
  along the residual path; recomputes the row statistics; writes the sum's gradient and per-program
  partial sums of the scale and bias gradients (summed outside, where XLA reduces across devices).

The kernels exist twice, with one interface: on Pallas's Mosaic GPU backend (fused_norm_mosaic.py,
Hopper and later) and on its Triton backend (fused_norm_triton.py, deprecated since jax 0.11 and to
be removed). `IMPLEMENTATIONS` lists them in order of preference: Mosaic GPU first, the supported
backend and the faster in the 406M step on H100 and H200; Triton's where Mosaic GPU declines a
shape, and XLA's fusions where neither takes it. Rows over 1024 features, which Mosaic GPU takes in
chunks (the 1.4B model's 2048), take Triton's first while a jax has it: the 1.4B step ran as fast
with either, and traced and compiled about 12 s sooner with Triton's (benchmarks/reports/2026-11-27-first-start.md).
Off the GPU both run in their interpreters, so the CPU tests check the same code (Mosaic GPU's
interpreter hangs on a kernel batched by `vmap`, as a pipeline's stages batch it; on a GPU it
runs). Under a mesh the kernels run per shard (`shard_map` over the rows' mesh axes); the feature
axis must be whole on each device. `unsupported` says when no kernel applies; the model then falls
back to plain XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.kernels import fused_norm_mosaic, fused_norm_triton, switch
from jaxdist.parallel import rules as rules_lib

IMPLEMENTATIONS = (fused_norm_mosaic, fused_norm_triton)


def unsupported(shape: tuple[int, ...], dtype, names) -> str | None:
    """Why no kernel can take an activation of this (..., features) shape, dtype and logical names
    here, or None where one can: the feature axis whole on each device, and what each
    implementation needs of the rows and features per device (each one's reason, joined)."""
    sharded = rules_lib.sharded_activation(tuple(names))
    shards = 1
    if sharded is not None:
        mesh, spec = sharded
        if spec[-1] is not None:
            return "the rules split the feature axis over devices"
        shards = rules_lib.axes_size(mesh, _row_axes(spec))
    rows = int(np.prod(shape[:-1])) // shards
    reasons = [implementation.unsupported(shape[-1], rows, dtype) for implementation in IMPLEMENTATIONS]
    return None if None in reasons else "; ".join(reasons)


def supported(shape: tuple[int, ...], names, dtype=jnp.bfloat16) -> bool:
    """Whether the kernels take an activation of this shape, logical names and dtype here."""
    return unsupported(shape, dtype, names) is None


def use_kernel(impl: str, x: jax.Array, names) -> bool:
    """Whether `model.impl.norm_impl` = `impl` runs the kernels on the activation `x` here (kernels/switch.py)."""
    return switch.wanted(impl) and switch.decide(
        "norm_impl", impl, unsupported(x.shape, x.dtype, names), "the residual adds and norms run as XLA's fusions")


def add_norm(x, delta, scale, bias, *, rms: bool, eps: float, names):
    """`(x + delta, norm(x + delta))`: the next residual and its normed rows.

    `x` and `delta` are (..., features) in the compute dtype; `scale` and `bias` (None for RMSNorm)
    are (features,). The norm is computed in float32 from the sum rounded to `x.dtype`, as the
    unfused `x + delta` then `norm` does. `names` are the activation's logical axis names.
    """
    return _add_norm(rms, eps, _shards(names), x, delta, scale, bias)


def norm(x, scale, bias, *, rms: bool, eps: float, names):
    """`norm(x)` with the same kernels (no residual add)."""
    return _norm(rms, eps, _shards(names), x, scale, bias)


def _shards(names) -> tuple | None:
    """(mesh, spec) of the activation under the rules of the forward pass, which its backward, traced
    later (maybe outside those rules, as a pipeline's), runs under too; None without a mesh."""
    return rules_lib.sharded_activation(tuple(names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _add_norm(rms, eps, shards, x, delta, scale, bias):
    return _forward(rms, eps, shards, x, delta, scale, bias)


def _add_norm_fwd(rms, eps, shards, x, delta, scale, bias):
    total, normed = _forward(rms, eps, shards, x, delta, scale, bias)
    return (total, normed), (total, scale, bias)


def _add_norm_bwd(rms, eps, shards, residuals, cotangents):
    total, scale, bias = residuals
    d_total, d_normed = cotangents
    d_sum, d_scale, d_bias = _backward(rms, eps, shards, total, d_normed, d_total, scale, bias is not None)
    return d_sum, d_sum, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm(rms, eps, shards, x, scale, bias):
    return _forward(rms, eps, shards, x, None, scale, bias)[1]


def _norm_fwd(rms, eps, shards, x, scale, bias):
    return _norm(rms, eps, shards, x, scale, bias), (x, scale, bias)


def _norm_bwd(rms, eps, shards, residuals, d_normed):
    x, scale, bias = residuals
    d_x, d_scale, d_bias = _backward(rms, eps, shards, x, d_normed, None, scale, bias is not None)
    return d_x, d_scale.astype(scale.dtype), None if bias is None else d_bias.astype(bias.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


# -- the kernels -------------------------------------------------------------------------------------


def normalize(total, rms: bool, eps: float):
    """(..., features) float32 -> (normalized rows before scale and bias, 1 / row std).

    The norm's math, shared by the kernels and the model's plain XLA path.
    """
    centered = total if rms else total - jnp.mean(total, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return centered * rstd, rstd


def implementation(features: int, rows: int, dtype):
    """The first of `IMPLEMENTATIONS` that takes `rows` rows (per device) of `features`, or None;
    rows that Mosaic GPU takes in several chunks go to it last."""
    several_chunks = fused_norm_mosaic.row_chunks(features) > 1
    order = sorted(IMPLEMENTATIONS, key=lambda each: several_chunks and each is fused_norm_mosaic)
    return next((each for each in order if each.unsupported(features, rows, dtype) is None), None)


def _implementation(x: jax.Array):
    """The implementation that runs this device's (..., features) activation."""
    return implementation(x.shape[-1], x.size // x.shape[-1], x.dtype)


def _forward_local(rms, eps, x, delta, scale, bias):
    return _implementation(x).forward_local(rms, eps, x, delta, scale, bias)


def _backward_local(rms, eps, has_bias, total, d_normed, d_total, scale):
    return _implementation(total).backward_local(rms, eps, has_bias, total, d_normed, d_total, scale)


# -- running per shard under a mesh -----------------------------------------------------------------


def _row_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes that split the rows: those of every entry but the feature axis."""
    return tuple(axis for entry in tuple(spec)[:-1] for axis in rules_lib.spec_axes(entry))


def _run_per_shard(shards, local, arrays: dict, row_wise: set[str], out_specs):
    """`local(**arrays)` on each shard of the rows of the (mesh, spec) `shards` (or once, with None);
    None entries stay out."""
    present = {name: value for name, value in arrays.items() if value is not None}

    def run(present):
        return local(**{**dict.fromkeys(arrays), **present})

    if shards is None:
        return run(present)
    mesh, spec = shards
    in_specs = {name: spec if name in row_wise else PartitionSpec() for name in present}
    partials = PartitionSpec(_row_axes(spec) or None, None)
    out_specs = tuple(spec if kind == "rows" else partials if kind == "partials" else None for kind in out_specs)
    return jax.shard_map(run, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False)(present)


def _forward(rms, eps, shards, x, delta, scale, bias):
    arrays = dict(x=x, delta=delta, scale=scale, bias=bias)
    local = functools.partial(_forward_local, rms, eps)
    return _run_per_shard(shards, local, arrays, {"x", "delta"}, ("rows", "rows"))


def _backward(rms, eps, shards, total, d_normed, d_total, scale, has_bias):
    arrays = dict(total=total, d_normed=d_normed, d_total=d_total, scale=scale)
    local = functools.partial(_backward_local, rms, eps, has_bias)
    outputs = ("rows", "partials", "partials" if has_bias else None)
    d_sum, d_scale, d_bias = _run_per_shard(shards, local, arrays, {"total", "d_normed", "d_total"}, outputs)
    return d_sum, d_scale.sum(0), None if d_bias is None else d_bias.sum(0)
