"""The MLP's backward matmul with GELU's gradient: XLA's matmul + pass against cuBLASLt's epilogue (GPU).

    JAXDIST_CUBLASLT_LOG=1 python3 benchmarks/bench_gelu_matmul.py

Backward through `gelu(pre) @ down`, XLA runs `d_post = d_out @ down.T` and then a pass over memory
for `d_pre = d_post * gelu'(pre)`; the model runs one cuBLASLt matmul with a DGELU epilogue instead
(kernels/gelu_matmul.py, `model.impl.gelu_grad_impl`). For the 406M and 1.4B recipes' shapes this prints
XLA's matmul alone, XLA's matmul and pass, and the cuBLASLt call with its largest difference from
XLA's result (the log prints each cuBLASLt algorithm's time, timed once per shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist
from jaxdist import kernels
from jaxdist.kernels.gelu_matmul import gelu_grad_matmul, unavailable_reason, xla_gelu_grad_matmul
from jaxdist.observe.timing import time_calls

SHAPES = {"406m": (16 * 1024, 1024, 4096), "1b4": (8 * 1024, 2048, 8192)}  # rows, embed, mlp


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    for status in kernels.build_kernels():
        print(status)
    if unavailable_reason() is not None:
        raise SystemExit(f"the cuBLASLt handler is unavailable here: {unavailable_reason()}")
    print(f"{'shape':<6} {'what':<26} {'ms':>7} {'TFLOP/s':>8} {'max |diff|':>11}")
    for name, (rows, embed, mlp) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 3)
        d_out = jax.random.normal(keys[0], (1, rows, embed), jnp.bfloat16)
        down = (jax.random.normal(keys[1], (mlp, embed), jnp.float32) * 0.02).astype(jnp.bfloat16)
        pre = jax.random.normal(keys[2], (1, rows, mlp), jnp.bfloat16)
        flops = 2 * rows * embed * mlp
        xla = jax.jit(xla_gelu_grad_matmul)
        want = np.asarray(xla(d_out, down, pre).astype(jnp.float32))
        runs = (("xla matmul alone", jax.jit(lambda d, w, p: jnp.einsum("...e,me->...m", d, w))),
                ("xla matmul + gelu' pass", xla), ("cublaslt DGELU epilogue", jax.jit(gelu_grad_matmul)))
        for label, fn in runs:
            ms = time_calls(fn, d_out, down, pre)
            diff = "" if label == "xla matmul alone" else \
                f"{np.max(np.abs(np.asarray(fn(d_out, down, pre).astype(jnp.float32)) - want)):11.4f}"
            print(f"{name:<6} {label:<26} {ms:7.3f} {flops / ms / 1e9:8.0f} {diff}")


if __name__ == "__main__":
    main()
