"""What the decoder's layers share: the logical names of their activations, how a parameter is
made (its logical names and role), casts, and the projections (through FP8 GEMMs where asked)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.models import fp8 as fp8_lib
from jaxdist.parallel import roles

Names = tuple[str | None, ...]

# The residual stream between blocks (and through the norms) names its length axis `seq`, apart
# from `length` inside attention and the MLP: rules may split `seq` over `tensor` (sequence
# parallelism), so that norms and residual adds are not repeated on every tensor-parallel device
# (off in the presets: measured slower at tensor=4 on H200, see
# benchmarks/reports/2026-11-27-stage4-unrolled-tensor4.md).
RESIDUAL: Names = ("batch", "seq", "embed")
HEADS: Names = ("batch", "length", "heads", "head_dim")  # q, k, v and attention's output
KV_HEADS: Names = ("batch", "length", "kv_heads", "head_dim")  # grouped-query attention's k and v

NORMAL = nnx.initializers.normal(0.02)
ZEROS = nnx.initializers.zeros_init()


def param(rngs: nnx.Rngs, init, shape: Sequence[int], names: Names, dtype, role: str = roles.WEIGHT) -> nnx.Param:
    """A parameter with its logical names and its role (parallel/roles.py: what decay, trust ratios
    and compression go by)."""
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=names, role=role)


def cast(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype) if x.dtype != dtype else x


def at_least_float32(x: jax.Array) -> jax.Array:
    return cast(x, jnp.promote_types(x.dtype, jnp.float32))


def project(fp8: bool, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """A projection `einsum(spec, x, w)`, through FP8 GEMMs with `fp8` (models/fp8.py)."""
    return fp8_lib.einsum(spec, x, w) if fp8 else jnp.einsum(spec, x, w)
