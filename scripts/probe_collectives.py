"""Gradient collectives by NCCL against copy-engine transfers, alone and beside matmuls (GPU).

    python3 scripts/probe_collectives.py [--gpus 2] [--elements 268435456] [--matmuls 20] [--side 8192] [--trace]

Data parallelism on one host loses its time where the gradients' all-reduce runs beside the
backward's matmuls: NCCL's kernels take SMs and memory bandwidth from them (BENCHMARKS.md, sixth
round). This probe asks whether copy engines, which take no SMs, do better. In one process on
`--gpus` GPUs it times, per float32 and bf16 gradient of `--elements` per GPU:

- NCCL: psum (all-reduce), psum_scatter (reduce-scatter), all_gather;
- the same three built from `all_to_all`, which XLA runs as peer memcpys on copy engines when
  compiled with `xla_gpu_use_memcpy_local_p2p` (collective-permutes stay NCCL kernels);

each alone, beside a chain of `--matmuls` bf16 `--side`^3 matmuls in the same program, and the chain
alone. `hidden` is the share of the collective's time the pair saves over running both apart.
With `--trace`, it also profiles each pair and prints the matmuls' and the transfers' kernel time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from profile_summary import gpu_kernels  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist.observe.bench import time_calls  # noqa: E402


def collectives(n: int) -> dict:
    """name -> (per-device function of the local gradient, compile with memcpy p2p)."""

    def a2a(x):
        return jax.lax.all_to_all(x, "d", 0, 0, tiled=True)

    def rs_a2a(g):
        return a2a(g.reshape(n, -1)).reshape(n, -1).sum(0)

    def ag_a2a(shard):
        return a2a(jnp.broadcast_to(shard, (n,) + shard.shape)).reshape(-1)

    return {
        "all-reduce nccl": (lambda g: jax.lax.psum(g, "d"), False),
        "all-reduce copy engines": (lambda g: ag_a2a(rs_a2a(g)), True),
        "reduce-scatter nccl": (lambda g: jax.lax.psum_scatter(g.reshape(n, -1), "d", tiled=True).reshape(-1), False),
        "reduce-scatter copy engines": (rs_a2a, True),
        "all-gather nccl": (lambda g: jax.lax.all_gather(g.reshape(n, -1)[0], "d", tiled=True), False),
        "all-gather copy engines": (lambda g: ag_a2a(g.reshape(n, -1)[0]), True),
    }


def main() -> None:
    jaxdist.use_cpu_devices()
    jaxdist.gpu_defaults()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--elements", type=int, default=256 * 2**20, help="gradient elements per GPU")
    parser.add_argument("--matmuls", type=int, default=20)
    parser.add_argument("--side", type=int, default=8192, help="the matmuls' size")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args()
    n = args.gpus
    mesh = Mesh(jax.devices()[:n], ("d",))
    side = args.side
    a = jax.device_put(jnp.ones((n * side, side), jnp.bfloat16), NamedSharding(mesh, P("d")))
    b = jax.device_put(jnp.full((side, side), 1 / side, jnp.bfloat16), NamedSharding(mesh, P()))

    def matmuls(x, w):
        return jax.lax.scan(lambda h, _: ((h @ w).astype(jnp.bfloat16), None), x, None, length=args.matmuls)[0]

    def compile_(parts, memcpy, g):
        def local(x, w, grad):
            return tuple(part(x, w, grad) for part in parts)

        f = jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P("d"), check_vma=False)
        options = {"xla_gpu_use_memcpy_local_p2p": True} if memcpy else {}
        return jax.jit(f).lower(a, b, g).compile(compiler_options=options)

    print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind}")
    print(f"{'dtype':9} {'collective':28} {'MiB':>6} {'alone ms':>9} {'matmuls':>8} {'both':>8} {'hidden':>7}")
    for dtype in (jnp.float32, jnp.bfloat16):
        g = jax.device_put(jnp.ones((n * args.elements,), dtype), NamedSharding(mesh, P("d")))
        mib = args.elements * jnp.dtype(dtype).itemsize / 2**20
        mm = time_calls(compile_([lambda x, w, _: matmuls(x, w)], False, g), a, b, g, repeats=10)
        for name, (collective, memcpy) in collectives(n).items():
            alone = time_calls(compile_([lambda x, w, grad: collective(grad)], memcpy, g), a, b, g, repeats=10)
            pair = compile_([lambda x, w, _: matmuls(x, w), lambda x, w, grad: collective(grad)], memcpy, g)
            both = time_calls(pair, a, b, g, repeats=10)
            print(f"{jnp.dtype(dtype).name:9} {name:28} {mib:6.0f} {alone:9.2f} {mm:8.2f} {both:8.2f} "
                  f"{(mm + alone - both) / alone:7.2f}", flush=True)
            if args.trace:
                print("    " + traced(pair, (a, b, g)), flush=True)


def traced(compiled, args) -> str:
    """The matmuls' kernel time, the transfers' (NCCL kernels or peer memcpys), and how much of
    the latter ran beside the former, in one profiled call."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            jax.block_until_ready(compiled(*args))
        trace = json.load(gzip.open(next(Path(folder).rglob("perfetto_trace.json.gz"))))
    kernels = gpu_kernels(trace)
    spans = {kind: [(e["ts"], e["ts"] + e["dur"]) for e in kernels if re.search(pattern, e["name"])]
             for kind, pattern in (("matmul", "gemm|nvjet|xmma"), ("transfer", "nccl|MemcpyP2P"))}
    beside = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in spans["matmul"] for s2, e2 in spans["transfer"])
    total = {kind: sum(e - s for s, e in spans[kind]) / 1e3 for kind in spans}
    return f"matmuls {total['matmul']:.2f} ms, transfers {total['transfer']:.2f} ms, {beside / 1e3:.2f} ms of them beside matmuls"


if __name__ == "__main__":
    main()
