"""What the Pallas Mosaic GPU kernels (fused_norm_mosaic.py, softmax_grad.py) share.

A program is one warpgroup (4 warps of 32 lanes). The kernels work on blocks of 4 rows: one row per
warp, its lanes across the columns, each lane holding runs of `vector` neighbouring values (16
bytes of bf16), so a row's sum is a sum in each lane and a shuffle across the warp, and each warp
loads and stores whole lines. Off the GPU the kernels run in Mosaic GPU's interpreter, which
ignores layouts: the CPU tests run the same kernel code.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl


@functools.cache
def plgpu():
    """Pallas's Mosaic GPU module, or None where this jaxlib lacks it (the XLA paths remain).

    Imported on first use, not with jaxdist: importing it sets `MOSAIC_GPU_CUDA_ROOT` in the
    process's environment.
    """
    try:
        from jax.experimental.pallas import mosaic_gpu
    except ImportError:
        return None
    return mosaic_gpu


def _interpret_params():
    params = getattr(plgpu(), "InterpretGPUParams", None)
    if params is None:  # jax 0.10 has the interpreter but does not export its parameters
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()

ROWS = 4  # rows per block: one per warp
LANES = 32


def unavailable() -> str | None:
    """Why Mosaic GPU kernels can't run here, or None: this jax must have the backend, and a GPU
    must be a Hopper or later (elsewhere, off the GPU, the kernels run in the interpreter)."""
    if plgpu() is None:
        return "this jax has no Pallas Mosaic GPU backend"
    if interpreting():
        return None
    capability = getattr(jax.devices()[0], "compute_capability", "9.0")
    if float(capability) < 9.0:
        return f"Mosaic GPU kernels need a Hopper or later GPU (compute capability 9.0), not {capability}"
    return None


def interpreting() -> bool:
    return jax.default_backend() != "gpu"


def vector(columns: int, itemsize: int) -> int | None:
    """Values per lane and run in a row of `columns`: the widest of 8, 4, 2, 1 (at most 16 bytes of
    `itemsize`) with whole runs of the warp's 32 lanes, or None (`columns` not a multiple of 32)."""
    return next((v for v in (8, 4, 2, 1) if v * itemsize <= 16 and columns % (LANES * v) == 0), None)


def block_layout(vector: int):
    """The register layout of (4, 32 * `vector` * k) blocks: row i on warp i, each lane `vector`
    neighbouring values per run of 32 * `vector` columns."""
    mgpu = plgpu()
    return mgpu.Layout.TILED(mgpu.Tiling(((ROWS, LANES * vector), (vector,))), warp_dims=(-3,), lane_dims=(-2,),
                             vector_dim=-1)


def load(ref, layout):
    """A global-memory block into registers."""
    if interpreting():
        return ref[...]
    return plgpu().load(ref, layout=layout, optimized=False)  # `optimized` transfers are for shared memory


def load_shared(ref, layout):
    """A (rows, runs, run) shared-memory block, as `stream` copies it, as (rows, columns) in `layout`."""
    rows, columns = ref.shape[0], ref.shape[1] * ref.shape[2]
    if interpreting():
        return ref[...].reshape(rows, columns)
    return plgpu().layout_cast(ref.reshape(rows, columns)[...], layout)


def relayout(x, layout):
    return x if interpreting() else plgpu().layout_cast(x, layout)


def per_row(values, shape, layout):
    """(rows,) -> (rows, columns) in `layout`, each row its value."""
    return relayout(jax.lax.broadcast_in_dim(values, shape, (0,)), layout)


def per_column(values, shape, layout):
    """(columns,) -> (rows, columns) in `layout`, each column its value."""
    return relayout(jax.lax.broadcast_in_dim(values, shape, (1,)), layout)


def runs(x: jax.Array) -> jax.Array:
    """(rows, columns) -> (rows, columns / run, run), run = 32 * `vector`: a copy moves at most 256
    values along each dimension."""
    run = LANES * vector(x.shape[1], x.dtype.itemsize)
    return x.reshape(x.shape[0], x.shape[1] // run, run)


def program():
    return jax.lax.axis_index("program")


def block_rows(block):
    """The rows of block `block`."""
    return pl.ds(block * ROWS, ROWS)


def stream(step, refs, programs: int, stages: int, carry=None, chunks: int = 1):
    """Calls `step(block, *shared_blocks[, carry])` on this program's contiguous share of the
    blocks of the (rows, runs, run) global `refs`, each copied into shared memory up to `stages`
    blocks ahead; returns the last carry. Each block's runs are split in `chunks` equal parts, each
    copied to a buffer of its own: `shared_blocks` holds, ref after ref, each ref's chunks in order.
    `step` ends with `end_step`."""
    blocks = refs[0].shape[0] // ROWS
    first = program() * blocks // programs
    count = (program() + 1) * blocks // programs - first
    runs_per_chunk = refs[0].shape[1] // chunks
    specs = [plgpu().BlockSpec((ROWS, runs_per_chunk, refs[0].shape[2]), lambda i, c=c: (first + i, c, 0))
             for c in range(chunks)]

    def body(index, *args):
        return step(first + index[0], *args)

    return plgpu().emit_pipeline(body, grid=(count,), in_specs=specs * len(refs), max_concurrent_steps=stages,
                               init_carry=carry)(*[ref for ref in refs for _ in range(chunks)])


def end_step():
    """Ends a `stream` step: every warp is done with the step's shared memory before it is refilled."""
    plgpu().commit_smem()


@functools.cache
def programs_per_device(per_multiprocessor: int) -> int:
    """Programs that keep every multiprocessor `per_multiprocessor` deep (4 in the interpreter)."""
    if interpreting():
        return 4
    return per_multiprocessor * jax.devices()[0].core_count


def kernel(body, out_type, programs: int, name: str, scratch=()):
    """`body(*input_refs, *output_refs, *scratch_refs)` on `programs` programs; inputs and outputs in
    global memory, each of `scratch` (shapes and dtypes) a shared-memory buffer of the program's own."""
    mgpu = plgpu()
    return mgpu.kernel(
        body, out_type=out_type, grid=(programs,), grid_names=("program",), kernel_name=name,
        scratch_types=[mgpu.SMEM(shape.shape, shape.dtype) for shape in scratch],
        compiler_params=mgpu.CompilerParams(
            lowering_semantics=mgpu.LoweringSemantics.Lane, approx_math=True,
            # No thread reads what another wrote, and `end_step` is the barrier before a shared
            # block is refilled.
            unsafe_no_auto_barriers=True),
        interpret=_interpret_params() if interpreting() else None)
