"""The transformer block's MLP: GELU (its gradient in cuBLASLt's epilogue on GPU), or gated: SwiGLU or
GeGLU (Gemma's gate through GELU's tanh form)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxdist.kernels import gelu_matmul
from jaxdist.models import fp8 as fp8_lib
from jaxdist.models.layers.common import NORMAL, RESIDUAL, ZEROS, cast, param, project
from jaxdist.parallel import roles
from jaxdist.parallel.rules import constrain

if TYPE_CHECKING:
    from jaxdist.models.gpt.config import GPTConfig, ImplConfig


class Mlp(nnx.Module):
    def __init__(self, cfg: GPTConfig, impl: ImplConfig, param_dtype, rngs: nnx.Rngs, fp8: bool = False):
        self.activation = cfg.activation
        self.fp8 = fp8
        self.gelu_grad_impl = impl.gelu_grad_impl
        self.recompute_activation = impl.remat == "mlp"
        self.up = param(rngs, NORMAL, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), param_dtype)
        gated = cfg.activation in ("swiglu", "geglu")
        if gated:
            self.gate = param(rngs, NORMAL, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"), param_dtype)
        down_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.down = param(rngs, down_init, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"), param_dtype)
        if cfg.biases == "all":
            self.up_bias = param(rngs, ZEROS, (cfg.mlp_dim,), ("mlp",), param_dtype, roles.BIAS)
            if gated:
                self.gate_bias = param(rngs, ZEROS, (cfg.mlp_dim,), ("mlp",), param_dtype, roles.BIAS)
            self.down_bias = param(rngs, ZEROS, (cfg.d_model,), ("embed",), param_dtype, roles.BIAS)

    def __call__(self, x: jax.Array) -> jax.Array:
        up = project(self.fp8, "btd,dm->btm", x, cast(self.up[...], x.dtype))
        h = constrain(self._bias("up_bias", up), ("batch", "length", "mlp"))
        gate = None
        if self.activation != "gelu":
            gate = project(self.fp8, "btd,dm->btm", x, cast(self.gate[...], x.dtype))
            gate = constrain(self._bias("gate_bias", gate), ("batch", "length", "mlp"))
        activate_and_project = self._activate_and_project
        if self.recompute_activation:
            # The backward pass recomputes the activation from the saved up-projection (one
            # elementwise pass) instead of keeping its output: batch x length x mlp per layer less.
            activate_and_project = jax.checkpoint(activate_and_project, policy=jax.checkpoint_policies.nothing_saveable)
        return constrain(self._bias("down_bias", activate_and_project(h, gate, cast(self.down[...], x.dtype))),
                         RESIDUAL)

    def _bias(self, name: str, y: jax.Array) -> jax.Array:
        return y + cast(getattr(self, name)[...], y.dtype) if hasattr(self, name) else y

    def _activate_and_project(self, h: jax.Array, gate: jax.Array | None, down: jax.Array) -> jax.Array:
        if self.activation == "swiglu":
            return project(self.fp8, "btm,md->btd", jax.nn.silu(gate) * h, down)
        if self.activation == "geglu":
            return project(self.fp8, "btm,md->btd", jax.nn.gelu(gate, approximate=True) * h, down)
        if self.fp8:  # the FP8 GEMM in place of the cuBLASLt GELU-gradient kernel's bfloat16 one
            # Kept for the backward, `h` would let XLA's GEMM rewriter fold the GELU into the up
            # projection's FP8 GEMM (a GELU_AUX epilogue), which cuBLASLt has no FP8 kernel for:
            # "No candidates could be compiled". The barrier keeps the two apart.
            return fp8_lib.einsum("btm,md->btd", gelu_matmul.gelu(jax.lax.optimization_barrier(h)), down)
        # Its backward keeps `h` and gelu(h), not the formula's tanh, and on GPU puts GELU's
        # gradient into the matmul's epilogue (kernels/gelu_matmul.py).
        return gelu_matmul.gelu_project(h, down, kernel=gelu_matmul.use_kernel(self.gelu_grad_impl, h, down))
