"""`gelu(pre) @ down` whose backward puts GELU's gradient into the matmul that needs it (GPU).

Backward through the MLP's `gelu(pre) @ down`, XLA computes `d_post = d_out @ down.T` and then, in
a second pass over memory, `d_pre = d_post * gelu'(pre)` (its cost: docs/performance.md). cuBLASLt can apply the gradient as the product leaves
the tensor cores (its `DGELU` epilogue, the one NVIDIA's Transformer Engine uses), but XLA's
rewrites never ask for it. `gelu_matmul.cc` calls it through XLA's FFI; `jaxdist build-kernels`, or
the first `train` or `bench` on a GPU, builds it (kernels/build.py), and the model only loads it.
Where it isn't built, or off the GPU, the same function runs as XLA.

Under a mesh the matmul runs per shard (`shard_map`): rows split as the batch is, the `mlp` axis as
the rules split it (tensor parallelism), `embed` whole on each device.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxdist.kernels import build, switch
from jaxdist.parallel import rules as rules_lib

WORKSPACE_BYTES = 32 * 2**20  # what cuBLAS asks for on Hopper

_SQRT_2_OVER_PI = 0.7978845608028654
PRE_NAMES = ("batch", "length", "mlp")
OUT_NAMES = ("batch", "length", "embed")


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (`jax.nn.gelu(approximate=True)`): what cuBLASLt's epilogues compute.

    Its gradient recomputes the tanh from `x`: autodiff of the formula keeps the tanh as well, one
    more activation of the MLP's width for every layer until the backward."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
    return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, d_out):
    return ((d_out.astype(jnp.float32) * gelu_slope(x.astype(jnp.float32))).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def gelu_slope(x: jax.Array) -> jax.Array:
    """d/dx of `gelu`, float32 in and out."""
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = jnp.tanh(inner)
    d_inner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


def _cuda_libraries() -> list[build.CudaLibrary]:
    return [build.find_cuda_library("cublasLt.h", "cublasLt"), build.find_cuda_library("cuda_runtime_api.h", "cudart")]


HANDLER = build.Handler("gelu_matmul", Path(__file__).with_name("gelu_matmul.cc"), "JaxdistGeluGradMatmul",
                        "jaxdist_gelu_grad_matmul", libraries=_cuda_libraries)


@functools.cache
def unavailable_reason() -> str | None:
    """Why the cuBLASLt handler can't run here, or None once its built library is loaded.

    The model asks while it is traced, so this never compiles: a handler not built is a reason.
    """
    if jax.default_backend() != "gpu":
        return "not on a GPU"
    try:
        build.load(HANDLER)
    except build.NativeBuildError as error:
        return f"{error}; run `jaxdist build-kernels`"
    except (OSError, AttributeError) as error:
        return str(error)
    return None


def use_kernel(impl: str, pre: jax.Array, down: jax.Array) -> bool:
    """Whether `model.impl.gelu_grad_impl` = `impl` runs the cuBLASLt kernel for `gelu(pre) @ down` here.

    `auto` takes it on a GPU where it is built and the operands suit it, warning once where it isn't
    built; `cublaslt` insists, raising with the reason.
    """
    if not switch.wanted(impl):
        return False
    reason = _unsuited(pre, down)
    if reason is not None:
        if impl == "cublaslt":
            raise ValueError(f"model.impl.gelu_grad_impl=cublaslt: {reason}")
        return False
    reason = unavailable_reason()
    if reason is not None and impl == "cublaslt":
        raise RuntimeError(f"model.impl.gelu_grad_impl=cublaslt: the cuBLASLt handler is unavailable: {reason}")
    return switch.decide("gelu_grad_impl", impl, reason, "the MLP's GELU gradient runs as a separate XLA pass")


def _unsuited(pre: jax.Array, down: jax.Array) -> str | None:
    """Why these operands (under the enclosing rules) don't suit the kernel, or None."""
    if pre.dtype != jnp.bfloat16 or down.dtype != jnp.bfloat16:
        return f"it takes bfloat16 activations, not {pre.dtype}"
    mlp_shards, embed_split = 1, False
    active = rules_lib.active()
    if active is not None:
        mesh, rules = active
        pre_spec, out_spec = _specs(rules)
        mlp_shards = rules_lib.axes_size(mesh, rules_lib.spec_axes(pre_spec[2]))
        embed_split = out_spec[2] is not None
    if embed_split:
        return "it needs `embed` whole on each device; the rules split it"
    # Rows of 16 bytes: what cuBLASLt's bf16 kernels need of a matrix's leading dimension.
    if down.shape[1] % 8 or (down.shape[0] // mlp_shards) % 8:
        return f"embed ({down.shape[1]}) and mlp per device ({down.shape[0] // mlp_shards}) must be multiples of 8"
    return None


def gelu_project(pre: jax.Array, down: jax.Array, kernel: bool) -> jax.Array:
    """`gelu(pre) @ down`; with `kernel`, its backward runs `gelu_grad_matmul` on cuBLASLt.

    pre: (batch, length, mlp); down: (mlp, embed), both in the compute dtype.
    """
    return _gelu_project(_Shards.here() if kernel else None, pre, down)


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Where the kernel runs per shard: the mesh (None: unsharded) and the specs of `pre` and `d_out`.

    Taken from the rules of the forward pass: the backward, traced later (maybe outside those
    rules, as a pipeline's), runs under them too."""

    mesh: Mesh | None = None
    pre_spec: PartitionSpec | None = None
    out_spec: PartitionSpec | None = None

    @classmethod
    def here(cls) -> _Shards:
        active = rules_lib.active()
        if active is None or active[0].size == 1:
            return cls()
        return cls(active[0], *_specs(active[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gelu_project(kernel, pre, down):
    return gelu(pre) @ down


def _gelu_project_fwd(kernel, pre, down):
    post = gelu(pre)
    return post @ down, (pre, post, down)


def _gelu_project_bwd(kernel, residuals, d_out):
    pre, post, down = residuals
    if kernel is None:
        d_pre = xla_gelu_grad_matmul(d_out, down, pre)
    else:
        d_pre = _grad_matmul_per_shard(kernel, d_out, down, pre)
    d_down = jnp.einsum("...m,...e->me", post, d_out)
    return d_pre, d_down


_gelu_project.defvjp(_gelu_project_fwd, _gelu_project_bwd)


def xla_gelu_grad_matmul(d_out: jax.Array, down: jax.Array, pre: jax.Array) -> jax.Array:
    """`(d_out @ down.T) * gelu'(pre)` as XLA runs it: the product, then a pass over memory."""
    return _gelu_bwd(pre, jnp.einsum("...e,me->...m", d_out, down))[0]


def gelu_grad_matmul(d_out: jax.Array, down: jax.Array, pre: jax.Array) -> jax.Array:
    """`(d_out @ down.T) * gelu'(pre)` in one cuBLASLt call per device (d_out: (batch, length, embed))."""
    return _grad_matmul_per_shard(_Shards.here(), d_out, down, pre)


def _grad_matmul_per_shard(shards: _Shards, d_out: jax.Array, down: jax.Array, pre: jax.Array) -> jax.Array:
    if shards.mesh is None:
        return _local(d_out, down, pre)
    pre_spec, out_spec = shards.pre_spec, shards.out_spec  # `embed` whole in out_spec: `use_kernel` checks
    down_spec = PartitionSpec(pre_spec[2], None)
    return jax.shard_map(_local, mesh=shards.mesh, in_specs=(out_spec, down_spec, pre_spec), out_specs=pre_spec,
                         check_vma=False)(d_out, down, pre)


def _specs(rules: rules_lib.Rules) -> tuple[PartitionSpec, PartitionSpec]:
    """The specs of `pre` and of `d_out` under these rules, one entry per dimension."""
    return (rules_lib.padded_spec(rules.activation_spec(PRE_NAMES), 3),
            rules_lib.padded_spec(rules.activation_spec(OUT_NAMES), 3))


def _local(d_out: jax.Array, down: jax.Array, pre: jax.Array) -> jax.Array:
    embed, mlp = down.shape[1], down.shape[0]
    # Under vmap (the per-shard gradients of train.microbatches) each
    # device holds one shard, so calling once per mapped index costs nothing.
    call = jax.ffi.ffi_call(
        HANDLER.target,
        (jax.ShapeDtypeStruct((pre.size // mlp, mlp), pre.dtype), jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
        vmap_method="sequential",
    )
    d_pre, _ = call(d_out.reshape(-1, embed), down, pre.reshape(-1, mlp))
    return d_pre.reshape(pre.shape)
