"""Probe: the MLP's backward matmul with GELU's gradient in its epilogue, against XLA (Hopper GPU).

    python3 scripts/bench_gelu_matmul.py

Backward through `gelu(h) @ down`, XLA runs a matmul `d_gelu = d_out @ down.T` that writes a
(rows, mlp) array, then an elementwise pass that reads it back with `h` and writes
`d_h = d_gelu * gelu'(h)`: at 406M that pass moves 384 MB per layer (3.7 ms per step on an H100).
cuBLASLt has such an epilogue (DGELU), but XLA has no rewrite that asks for it. The kernel here
(Pallas, Mosaic GPU: TMA copies and warpgroup MMAs, laid out as JAX's Hopper matmul example is: one
thread block per SM walking output tiles in snake order, a producer warpgroup filling shared
memory, two consumer warpgroups each owning half of a tile's columns) loads the tile of `h` into
shared memory while the tile's matmul runs and writes only `d_h`.

Not in the model: on one H100 it matches XLA's matmul + pass at 406M (0.295 vs 0.310 ms per layer)
and is 6% faster at 1.4B (0.451 vs 0.481 ms), not more, because its epilogue does not overlap the
tensor cores (the bare matmul takes 0.181 / 0.348 ms), and the model would also need `down`
transposed. Computing gelu' during the tile's matmul instead (one piece per step, beside the
in-flight MMA, leaving a multiply for the epilogue) changed nothing (0.290-0.298 ms at 406M), so
the math is not what stalls: more likely h coming in and d_h going out (256 MB per layer through
memory) in bursts at each tile's start and end. Next: spread those over the matmul (stores of one
tile during the next one's steps), and read `down` untransposed.

Prints, for the 406M and 1.4B recipes' shapes, XLA's matmul alone, XLA's matmul and its
GELU-gradient pass, and the kernel for a few tile choices with its largest difference from XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.extend import backend

from jaxdist.models.gelu_matmul import gelu_grad_matmul, gelu_slope, unavailable_reason

try:  # Mosaic GPU: present in jaxlib builds with CUDA support
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:
    plgpu = None

@dataclasses.dataclass(frozen=True)
class Tiles:
    """Each consumer warpgroup's (rows, cols) output tile, the contraction step, the pipeline's
    depth in steps, the epilogue's square sub-tile, and how many tiles wide the snake walk runs."""

    rows: int = 128
    cols: int = 128
    depth: int = 64
    stages: int = 3
    epilogue: int = 64
    snake_width: int = 4


def kernel_applies(rows: int, depth: int, cols: int, dtype, tiles: Tiles = Tiles()) -> bool:
    """Whether the GPU kernel takes (rows, depth) @ (depth, cols) in `dtype` here."""
    return (plgpu is not None and jax.default_backend() == "gpu" and jnp.dtype(dtype) == jnp.bfloat16
            and rows % tiles.rows == 0 and cols % (2 * tiles.cols) == 0 and depth % tiles.depth == 0)


def matmul_gelu_grad(d_out: jax.Array, down_t: jax.Array, h: jax.Array, tiles: Tiles = Tiles()) -> jax.Array:
    """`(d_out @ down_t) * gelu'(h)` in `h`'s dtype, the product accumulated in float32.

    d_out: (rows, embed); down_t: (embed, mlp), the down-projection transposed; h: (rows, mlp), the
    up-projection's output. Runs the Hopper kernel where `kernel_applies`, else XLA.
    """
    rows, depth = d_out.shape
    cols = down_t.shape[1]
    if not kernel_applies(rows, depth, cols, h.dtype, tiles):
        product = jnp.dot(d_out, down_t, preferred_element_type=jnp.float32)
        return (product * gelu_slope(h.astype(jnp.float32))).astype(h.dtype)
    return _hopper(d_out, down_t, h, tiles)


def _hopper(a, b, h, tiles: Tiles):
    rows, cols = a.shape[0], b.shape[1]
    sms = backend.get_default_device().core_count
    return plgpu.kernel(
        functools.partial(_hopper_body, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((rows, cols), h.dtype),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,  # two consumer warpgroups and the producer the pipeline adds
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(a, b, h)


def _smem_transforms(minor_elems: int, itemsize: int = 2):
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _hopper_body(a_gmem, b_gmem, h_gmem, out_gmem, *, tiles: Tiles):
    rows, depth = a_gmem.shape
    cols = b_gmem.shape[1]
    block_cols = 2 * tiles.cols  # the two consumer warpgroups side by side
    row_tiles, col_tiles = rows // tiles.rows, cols // block_cols
    epi = tiles.epilogue
    operand_transforms = _smem_transforms(tiles.depth)

    def pipeline(mma, consume):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(depth // tiles.depth,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tiles.rows, tiles.depth), lambda k: (0, k), transforms=operand_transforms,
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((tiles.depth, block_cols), lambda k: (k, 0), transforms=operand_transforms,
                                memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages,
            compute_context=consume,
        )

    unused = lambda *_, **__: None  # noqa: E731  (allocation sizes don't depend on the bodies)
    sub_rows, sub_cols = tiles.rows // epi, tiles.cols // epi

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(unused, unused).get_allocations(a_gmem, b_gmem),
        # Each consumer warpgroup's tile of h, in epilogue-sized pieces: loaded while the matmul
        # runs, then overwritten with the result and copied out from there.
        h_smem=plgpu.SMEM((2, sub_rows, sub_cols, epi, epi), h_gmem.dtype, transforms=_smem_transforms(epi)),
        h_arrived=plgpu.Barrier(num_barriers=2 * sub_rows * sub_cols),
        collective_axes="wg",
    )
    def _scope(allocations, h_smem, h_arrived):
        wg = jax.lax.axis_index("wg")
        pieces = [(i, j) for i in range(sub_rows) for j in range(sub_cols)]

        @plgpu.nd_loop((row_tiles * col_tiles,), collective_axes="sm")
        def _tile(loop):
            (linear,) = loop.index
            row_tile, col_tile = plgpu.planar_snake(linear, (row_tiles, col_tiles), 1, tiles.snake_width)
            block_rows = pl.ds(row_tile * tiles.rows, tiles.rows)
            block = pl.ds(col_tile * block_cols, block_cols)
            my_cols = pl.ds(wg * tiles.cols, tiles.cols)

            def piece_of(ref, i, j):
                return ref.at[block_rows, block].at[:, my_cols].at[pl.ds(i * epi, epi), pl.ds(j * epi, epi)]

            def mma(_, a_smem, b_smem, acc):
                plgpu.wgmma(acc, a_smem, b_smem.at[:, my_cols])
                plgpu.wgmma_wait(0)
                return acc

            def consume(run_pipeline):
                # The last tile's results must have left shared memory before h overwrites them.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for n, (i, j) in enumerate(pieces):
                    plgpu.copy_gmem_to_smem(piece_of(h_gmem, i, j), h_smem.at[wg, i, j],
                                            h_arrived.at[wg * len(pieces) + n])

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tiles.rows, tiles.cols), jnp.float32))
                def _acc(acc):
                    run_pipeline(acc)
                    product = acc[...]
                    for n, (i, j) in enumerate(pieces):
                        plgpu.barrier_wait(h_arrived.at[wg * len(pieces) + n])
                        h = h_smem[wg, i, j].astype(jnp.float32)
                        part = product[i * epi:(i + 1) * epi, j * epi:(j + 1) * epi]
                        h_smem[wg, i, j] = (part * gelu_slope(h)).astype(h_gmem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(h_smem.at[wg, i, j], piece_of(out_gmem, i, j))

            pipeline(mma, consume)(a_gmem.at[block_rows, :], b_gmem.at[:, block], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


SHAPES = {"406m": (16 * 1024, 1024, 4096), "1b4": (8 * 1024, 2048, 8192)}  # rows, embed, mlp
TILES = (Tiles(), Tiles(snake_width=8), Tiles(depth=32, stages=6), Tiles(rows=64, stages=4))


def timed(fn, *args, repeats: int = 30) -> float:
    """Milliseconds per call, `repeats` calls without a sync between them."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    mosaic = "--mosaic" in sys.argv[1:]
    print(f"{'shape':<6} {'what':<34} {'ms':>7} {'TFLOP/s':>8} {'max |diff|':>11}")
    for name, (rows, embed, mlp) in SHAPES.items():
        keys = jax.random.split(jax.random.key(0), 3)
        d_out = jax.random.normal(keys[0], (rows, embed), jnp.bfloat16)
        down_t = (jax.random.normal(keys[1], (embed, mlp), jnp.float32) * 0.02).astype(jnp.bfloat16)
        h = jax.random.normal(keys[2], (rows, mlp), jnp.bfloat16)
        flops = 2 * rows * embed * mlp
        matmul = jax.jit(lambda d, w: d @ w)
        xla = jax.jit(lambda d, w, h: ((d @ w).astype(jnp.float32) * gelu_slope(h.astype(jnp.float32))).astype(h.dtype))
        want = xla(d_out, down_t, h).astype(jnp.float32)
        for label, fn, args in (("xla matmul alone", matmul, (d_out, down_t)),
                                ("xla matmul + gelu' pass", xla, (d_out, down_t, h))):
            ms = timed(fn, *args)
            print(f"{name:<6} {label:<34} {ms:7.3f} {flops / ms / 1e9:8.0f}")
        if unavailable_reason() is None:
            down = down_t.T.copy()  # (mlp, embed), as the model stores it
            fn = jax.jit(lambda d, w, h: gelu_grad_matmul(d[None], w, h[None])[0])
            ms = timed(fn, d_out, down, h)
            diff = float(np.max(np.abs(np.asarray(fn(d_out, down, h).astype(jnp.float32) - want))))
            print(f"{name:<6} {'cublaslt DGELU epilogue':<34} {ms:7.3f} {flops / ms / 1e9:8.0f} {diff:11.4f}")
        else:
            print(f"cublaslt unavailable: {unavailable_reason()}")
        for tiles in TILES if mosaic else ():
            if not kernel_applies(rows, embed, mlp, h.dtype, tiles):
                continue
            label = f"{tiles.rows}x{tiles.cols}x{tiles.depth} s{tiles.stages} snake{tiles.snake_width}"
            fn = jax.jit(lambda d, w, h, t=tiles: matmul_gelu_grad(d, w, h, t))
            try:
                ms = timed(fn, d_out, down_t, h)
                diff = float(np.max(np.abs(np.asarray(fn(d_out, down_t, h).astype(jnp.float32) - want))))
            except Exception as error:  # a tile choice may not compile (shared memory): report, go on
                print(f"{name:<6} {label:<34} failed: {type(error).__name__}: {str(error)[:1500]}")
                continue
            print(f"{name:<6} {label:<34} {ms:7.3f} {flops / ms / 1e9:8.0f} {diff:11.4f}")


if __name__ == "__main__":
    main()
