"""The dtype policy: which dtype parameters are stored in and which the model computes in.

Parameters (and optimizer state) live in `param_dtype`, float32 master weights by default; the
model casts them to `compute_dtype` for matmuls; losses, the softmax and gradient accumulation
are float32. Loss scaling for float16 lives with the step (`jaxdist.train.precision`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdist.config import PrecisionConfig
from jaxdist.errors import UserError
from jaxdist.models import fp8 as fp8_lib


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in and computed in (outputs and reductions: float32), and
    whether the projections that can run as FP8 GEMMs do (`precision.fp8` where the devices have them)."""

    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    fp8: bool = False


def compute_dtype_name(precision: PrecisionConfig, backend: str | None = None) -> str:
    """`precision.compute` with `auto` resolved: bfloat16 on accelerators, float32 on CPU."""
    if precision.compute != "auto":
        return precision.compute
    backend = backend or jax.default_backend()
    return "float32" if backend == "cpu" else "bfloat16"


def policy(precision: PrecisionConfig, backend: str | None = None) -> Policy:
    """The dtype policy of a `precision:` config section."""
    return Policy(
        param_dtype=jnp.dtype(precision.params),
        compute_dtype=jnp.dtype(compute_dtype_name(precision, backend)),
        fp8=precision.fp8 and fp8_lib.supported(jax.local_devices(backend=backend)),
    )


def fp8_unavailable(precision: PrecisionConfig, backend: str | None = None) -> str | None:
    """Why `precision.fp8` runs without FP8 on this backend's devices (the one line a run prints); None
    where it is off or runs."""
    if not precision.fp8 or policy(precision, backend).fp8:
        return None
    reason = fp8_lib.unavailable_reason(jax.local_devices(backend=backend))
    return f"precision.fp8: {reason}; the projections run in {compute_dtype_name(precision, backend)}"


def check_backend(precision: PrecisionConfig, backend: str | None = None) -> None:
    """Rejects dtypes the backend cannot run, before anything compiles."""
    backend = backend or jax.default_backend()
    if compute_dtype_name(precision, backend) == "float16" and backend == "cpu":
        raise UserError(
            "precision.compute=float16: XLA on CPU cannot compile float16 attention "
            "(jax.nn.dot_product_attention); use bfloat16 or float32 on CPU, float16 on GPU"
        )
