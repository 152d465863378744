"""Does XLA fuse the MLP's GELU into the up-projection's cuBLASLt epilogue, under which XLA flags?

    python3 scripts/probe_gelu_epilogue.py [--flags "--xla_a=1 --xla_b=2" ...]

Compiles `gelu(x @ w)` at the 406M recipe's MLP shape (16 x 1024 rows, 1024 -> 4096, bf16) in a few
forms (bf16 weight, float32 weight cast first, with the pre-activation also returned as the
backward needs it, and the MLP's gradient), once per flag set in a fresh process, and prints per
form the time and the GEMM epilogues in the optimized HLO. A `GELU` or `GELU_AUX` epilogue means
the separate GELU pass (2.6 ms per step forward at 406M on an H100) is gone. Each set is all the
child runs with: jaxdist's default flags (`jaxdist.gpu_defaults()`) are not added, so "" is XLA's
own defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

DEFAULT_FLAG_SETS = (
    "",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_cublaslt=true --xla_gpu_enable_triton_gemm=false",
)


def forms():
    import jax
    import jax.numpy as jnp

    from jaxdist.kernels.gelu_matmul import gelu_project

    rows, d, hidden = 16 * 1024, 1024, 4096
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, d), jnp.bfloat16)
    w = jax.random.normal(keys[1], (d, hidden), jnp.float32) * 0.02
    w2 = jax.random.normal(keys[2], (hidden, d), jnp.float32) * 0.02

    def mlp_loss(x, w, w2):
        # The model's MLP with XLA's GELU-gradient pass (kernel=False): what XLA's rewrites see.
        return jnp.sum(gelu_project(x @ w.astype(x.dtype), w2.astype(x.dtype), kernel=False).astype(jnp.float32))

    return {
        "bf16 weight": (lambda x, w: jax.nn.gelu(x @ w, approximate=True), (x, w.astype(jnp.bfloat16))),
        "f32 weight, cast": (lambda x, w: jax.nn.gelu(x @ w.astype(x.dtype), approximate=True), (x, w)),
        "with pre-activation": (lambda x, w: (jax.nn.gelu(h := x @ w.astype(x.dtype), approximate=True), h), (x, w)),
        "MLP gradient": (jax.grad(mlp_loss, argnums=(0, 1, 2)), (x, w, w2)),
    }


def probe() -> None:
    """Runs in the child process: one JSON line per form, under the XLA_FLAGS it was started with."""
    import jax

    for name, (fn, args) in forms().items():
        compiled = jax.jit(fn).lower(*args).compile()
        text = compiled.as_text()
        jax.block_until_ready(compiled(*args))
        start = time.perf_counter()
        for _ in range(20):
            out = compiled(*args)
        jax.block_until_ready(out)
        epilogues = re.findall(r'"epilogue":"([A-Z_]+)"', text)
        print(json.dumps({
            "form": name, "ms": round((time.perf_counter() - start) / 20 * 1e3, 3),
            "gelu_epilogues": sum("GELU" in e for e in epilogues), "epilogues": sorted(set(epilogues)),
            "triton_gemms": text.count("__triton_gemm"), "cublaslt_calls": text.count("__cublas$lt$matmul"),
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flags", action="append", help="an XLA_FLAGS value to try (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        probe()
        return
    print(f"{'XLA flags':<70} {'form':<22} {'ms':>7} {'GELU epi':>8}  epilogues")
    for flags in args.flags or DEFAULT_FLAG_SETS:
        env = {**os.environ, "XLA_FLAGS": flags}
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{flags or '(none)':<70} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:100]}")
        for row in lines:
            print(f"{flags or '(none)':<70} {row['form']:<22} {row['ms']:>7} {row['gelu_epilogues']:>8}  "
                  f"{','.join(row['epilogues'])}")


if __name__ == "__main__":
    main()
