"""Checks and times the fused residual-add + norm kernels against XLA's fusions, on the GPU.

    python3 benchmarks/bench_fused_norm.py [--shape 16 1024 1024] [--norm layernorm|rmsnorm]

For random bf16 activations of the given shape, for each kernel implementation this jax has
(Mosaic GPU; Triton while the backend lasts): the largest relative error of both outputs and all
gradients against the unfused float32 reference, and the median time of one forward + backward
(the gradient of a linear function of both outputs), as for XLA, with the bytes each must move at
least and the bandwidth that implies. `--sweep` times the Mosaic GPU kernels' settings.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist
from jaxdist.kernels import fused_norm, fused_norm_mosaic, fused_norm_triton
from jaxdist.models.gpt import RESIDUAL


# Mosaic GPU settings to try: blocks in flight (copies ahead) and programs per multiprocessor,
# forward and backward.
SWEEP = [
    dict(FORWARD_STAGES=f_stages, FORWARD_PROGRAMS_PER_SM=f_programs, BACKWARD_STAGES=b_stages,
         BACKWARD_PROGRAMS_PER_SM=b_programs)
    for f_stages, f_programs, b_stages, b_programs in [
        (2, 2, 2, 2), (3, 2, 3, 2), (2, 3, 2, 1), (2, 4, 1, 2), (4, 2, 3, 1), (1, 3, 2, 2), (3, 3, 1, 1),
    ]
]


def unfused(x, delta, scale, bias, rms):
    total = x + delta
    x32 = total.astype(jnp.float32)
    if not rms:
        x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * scale
    return total, (y if bias is None else y + bias).astype(x.dtype)


def fused(x, delta, scale, bias, rms):
    return fused_norm.add_norm(x, delta, scale, bias, rms=rms, eps=1e-5, names=RESIDUAL)


def step(fn, rms):
    def loss(x, delta, scale, bias, w_total, w_normed):
        total, normed = fn(x, delta, scale, bias, rms)
        as32 = lambda a: a.astype(jnp.float32)
        return jnp.vdot(as32(total), as32(w_total)) + jnp.vdot(as32(normed), as32(w_normed))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def median_ms(fn, args, repeats=50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[16, 1024, 1024])
    parser.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm")
    parser.add_argument("--sweep", action="store_true", help="also time other pipeline depths and program counts")
    args = parser.parse_args()
    rms = args.norm == "rmsnorm"
    shape, features = tuple(args.shape), args.shape[-1]
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], shape, jnp.bfloat16) * 2 + 1
    delta = jax.random.normal(keys[1], shape, jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(keys[2], (features,))
    bias = None if rms else 0.1 * jax.random.normal(keys[3], (features,))
    weights = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys[4:]]
    operands = (x, delta, scale, bias, *weights)

    # Fewest bytes: forward reads x, delta, writes sum, normed; backward reads sum, d_normed,
    # d_sum and writes the input gradient (4 + 4 arrays of the activation).
    floor_bytes = 8 * np.prod(shape) * 2
    rows = int(np.prod(shape[:-1]))
    as32 = [a.astype(jnp.float32) if a is not None else None for a in operands]
    want = step(unfused, rms)(*as32)
    for implementation in (fused_norm_mosaic, fused_norm_triton):
        label = implementation.__name__.rsplit("_", 1)[-1]
        if (reason := implementation.unsupported(features, rows, jnp.bfloat16)) is not None:
            print(f"{label:>7}: not here ({reason})")
            continue
        fused_norm.IMPLEMENTATIONS = (implementation,)
        got = step(fused, rms)(*operands)
        errors = [float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
                  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]))]
        ms = median_ms(step(fused, rms), operands)
        print(f"{label:>7}: {ms:7.3f} ms fwd+bwd, {floor_bytes / ms / 1e6:6.0f} GB/s of the {floor_bytes / 2**20:.0f} "
              f"MiB floor; relative error vs float32 (dx, ddelta, dscale, dbias): {[f'{e:.1e}' for e in errors]}")
    ms = median_ms(step(unfused, rms), operands)
    print(f"{'xla':>7}: {ms:7.3f} ms fwd+bwd, {floor_bytes / ms / 1e6:6.0f} GB/s")
    if args.sweep:
        fused_norm.IMPLEMENTATIONS = (fused_norm_mosaic,)
        default = {name: getattr(fused_norm_mosaic, name) for name in SWEEP[0]}
        for setting in SWEEP:
            for name, value in setting.items():
                setattr(fused_norm_mosaic, name, value)
            print(f"{median_ms(step(fused, rms), operands):7.3f} ms  {setting}")
        for name, value in default.items():
            setattr(fused_norm_mosaic, name, value)


if __name__ == "__main__":
    main()
