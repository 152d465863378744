"""Pipeline parallelism: the stacked layers split into stages over the `stage` mesh axis.

A model with a stack of identical layers (a leading `layers` axis on every layer parameter) runs
it through `run_layers`. With a stage axis of size S > 1 in the active mesh, the stack is viewed
as (repeats R, stages S, layers per stage, ...): layer group g = r * S + s runs on stage s, so with
R > 1 the groups go round-robin over the stages (circular / interleaved schedule). The batch is
split into M microbatches that flow through the stages in one `lax.scan` over R * M + S - 1
iterations; every iteration each stage runs its layers on one microbatch (all stages at once, as a
`vmap` whose stage dim is sharded over the mesh), then the outputs move one stage on (a roll of the
stage dim, which XLA turns into a collective permute). The backward pass is autodiff of that
scan, i.e. GPipe: all forwards, then all backwards. A stage is idle for S - 1 of the iterations,
the bubble (S - 1) / (R * M + S - 1).

Buffers, all with the stage dim split over the mesh so each device holds only its stage's rows:

- `io`, shape (S, M / S, microbatch...): the inputs, then the outputs. Each iteration reads the
  input of stage 0 from row 0 of one column, shifts that column up one stage and writes the last
  stage's output into its bottom row (the MaxText `state_io` scheme: one microbatch moves per
  device per iteration, and the finished outputs end up spread over the stages).
- `recycle`, shape (S, M / S - 1, microbatch...), only with R > 1 and M > S: the same kind of
  conveyor, holding each last-stage output until stage 0 runs that microbatch's next repeat,
  M - S + 1 iterations later. With M == S the output goes straight from the last stage to the
  first.

Bubble iterations compute on stale or zero inputs and their results are never read, so they add
time but no gradient. Layers stay in their canonical order in the parameters; with R > 1 the
stored (contiguous) block of a device is not the round-robin set it runs, so the step regroups
them with one all-to-all over the stage axis (parameters in, gradients out).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import UserError
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.microbatches import merge_microbatches, split_microbatches

if TYPE_CHECKING:
    from jaxdist.config import Config, PipelineConfig, RulesConfig

# Logical name of the stage dim of pipeline buffers (an activation rule maps it to mesh axes).
STAGE = "stage"
# Logical name of the stacked-layer dim of layer parameters.
LAYERS = "layers"

ApplyLayers = Callable[[jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Sizes of one pipelined pass: S stages, M microbatches, R repeats (circular when R > 1)."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def iterations(self) -> int:
        """Scan iterations: each microbatch passes R * S stage slots, the last one S - 1 after the first."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of iterations a stage idles: (S - 1) / (R * M + S - 1)."""
        return (self.stages - 1) / self.iterations

    def check(self, layers: int, batch: int | None = None) -> None:
        """Raises a `UserError` naming the config key if this schedule cannot run `layers` layers."""
        stages, micro, repeats = self.stages, self.microbatches, self.repeats
        if layers % (stages * repeats):
            raise UserError(
                f"model.layers={layers} is not divisible by mesh.stage x pipeline.repeats = "
                f"{stages} x {repeats} = {stages * repeats}; use a multiple of {stages * repeats} layers "
                f"or change mesh.stage / pipeline.repeats"
            )
        if micro < stages:
            raise UserError(
                f"pipeline.microbatches={micro} is less than mesh.stage={stages}: stages would idle "
                f"on every step; use at least {stages} (more shrinks the bubble (S-1)/(M+S-1))"
            )
        if micro % stages:
            raise UserError(
                f"pipeline.microbatches={micro} is not a multiple of mesh.stage={stages}; use a "
                f"multiple such as {stages * math.ceil(micro / stages)}"
            )
        if batch is not None and batch % micro:
            raise UserError(
                f"pipeline.microbatches={micro} does not divide the {batch} rows each batch shard "
                f"gets per gradient-accumulation step (train.global_batch / batch shards / "
                f"train.microbatches); pick a divisor of {batch}"
            )


def check_config(cfg: Config, mesh_shape: dict[str, int], rows: int) -> None:
    """The pipeline checks `layout.check` runs before anything compiles; `rows` is what each
    batch shard gets per gradient-accumulation step."""
    if mesh_shape["stage"] == 1:
        return
    if cfg.model.layer_stack is None:
        raise UserError(
            f"mesh.stage={mesh_shape['stage']} pipelines a stack of identical layers, and model.name={cfg.model.name} "
            f"has none; use mesh.stage=1"
        )
    if not cfg.impl.scan_layers:
        raise UserError(
            f"mesh.stage={mesh_shape['stage']} pipelines the stacked layer stack, but impl.scan_layers=false "
            f"gives each layer its own parameters; set impl.scan_layers=true"
        )
    Schedule(mesh_shape["stage"], cfg.pipeline.microbatches, cfg.pipeline.repeats).check(cfg.model.layer_stack, rows)


def rules_from_config(rules_cfg: RulesConfig, mesh_shape: dict[str, int]) -> rules_lib.Rules:
    """The configured rules; with a stage axis, the `layers` dim of parameters split over it.

    An explicit `rules.params.layers` in the config wins (e.g. null keeps every layer on every
    stage, trading memory for no regrouping).
    """
    rules = rules_lib.from_config(rules_cfg)
    if mesh_shape["stage"] > 1 and LAYERS not in rules_cfg.params:
        rules = rules.override(params={LAYERS: "stage"})
    return rules


def run_layers(
    apply_layers: ApplyLayers,
    layers: Any,
    x: jax.Array,
    settings: PipelineConfig | None,
    names: Sequence[str | None],
) -> jax.Array:
    """`apply_layers(x, layers)`, pipelined over the stage axis when the active mesh has one.

    `layers` is a pytree whose leaves have a leading stacked-layer dim; `apply_layers(x, some)`
    runs a contiguous slice of them in order. `names` are the logical names of `x`'s dims (the
    first one the batch). Without active rules, a stage axis or pipeline settings, or when the
    batch does not split into microbatches across its shards (e.g. sampling a few rows), it runs
    unpipelined: the same math, with the layer parameters gathered from their stages.
    """
    active = rules_lib.active()
    if settings is None or active is None:
        return apply_layers(x, layers)
    mesh, rules = active
    rules.activation_spec((STAGE, names[0]), "a pipeline buffer")  # a UserError if a rule is missing
    stage_axes = rules.activations[STAGE]
    stages = rules_lib.axes_size(mesh, stage_axes)
    if stages == 1 or x.shape[0] % (settings.microbatches * rules_lib.axes_size(mesh, rules.activations[names[0]])):
        return apply_layers(x, layers)
    schedule = Schedule(stages, settings.microbatches, settings.repeats)
    schedule.check(jax.tree.leaves(layers)[0].shape[0])
    return pipeline(apply_layers, layers, x, schedule, mesh, tuple(names), stage_axes, remat=settings.remat)


def pipeline(
    apply_layers: ApplyLayers,
    layers: Any,
    x: jax.Array,
    schedule: Schedule,
    mesh: Mesh,
    names: tuple[str | None, ...],
    stage_axes: tuple[str, ...],
    remat: bool = False,
) -> jax.Array:
    """The pipelined `apply_layers(x, layers)`, traced under `rules.activation_rules` (see module doc)."""
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    columns = micro // stages
    weights = jax.tree.map(lambda w: _by_stage(w, schedule, mesh, stage_axes), layers)

    stage_of = jnp.arange(stages)
    is_first = _along_stages(stage_of == 0, x.ndim)
    is_last = _along_stages(stage_of == stages - 1, x.ndim)
    buffer_names = (STAGE, *names)
    conveyor_names = (STAGE, None, *names)

    run_stages = jax.vmap(apply_layers, spmd_axis_name=stage_axes)
    pick_repeat = jax.vmap(lambda w, r: w[r], in_axes=(1, 0), spmd_axis_name=stage_axes)

    def run_iteration(stage_in: jax.Array, t: jax.Array) -> jax.Array:
        if repeats == 1:
            return run_stages(stage_in, jax.tree.map(lambda w: w[0], weights))
        # Stage s runs pass t - s; its repeat is which lap of the M microbatches that pass is in.
        repeat = jnp.clip((t - stage_of) // micro, 0, repeats - 1)
        return run_stages(stage_in, jax.tree.map(lambda w: pick_repeat(w, repeat), weights))

    if remat:
        # The backward pass keeps only each iteration's stage inputs and recomputes the rest, the
        # weights picked for the iteration (R > 1) included; without remat it keeps a copy of
        # those per iteration. Nothing is CSE'd across scan iterations, so prevent_cse would only
        # cost speed.
        run_iteration = jax.checkpoint(run_iteration, prevent_cse=False)

    def convey(column: jax.Array, bottom: jax.Array) -> jax.Array:
        """A conveyor column moved up one stage (row 0 leaves), with `bottom` entering the last row."""
        return jnp.where(is_last, bottom, jnp.roll(column, -1, axis=0))

    def iteration(carry, t):
        previous, io, recycle = carry
        column = _column(io, t % columns)
        shifted = jnp.roll(previous, 1, axis=0)  # stage s gets what stage s - 1 made last iteration
        first_in = column  # microbatch t while t < M; with R == 1 later reads are bubble
        if recycle is not None:
            lap = _column(recycle, t % (columns - 1))
            first_in = jnp.where(t < micro, column, lap)
            recycle = _set_column(recycle, t % (columns - 1), convey(lap, previous))
        elif repeats > 1:
            first_in = jnp.where(t < micro, column, shifted)
        stage_in = rules_lib.constrain(jnp.where(is_first, first_in, shifted), buffer_names)
        out = rules_lib.constrain(run_iteration(stage_in, t), buffer_names)
        io = _set_column(io, t % columns, convey(column, out))
        return (out, io, recycle), None

    microbatches = split_microbatches(x, micro)  # constrained like the batch, per microbatch
    io = rules_lib.constrain(microbatches.reshape(stages, columns, *microbatches.shape[1:]), conveyor_names)
    previous = rules_lib.constrain(jnp.zeros((stages, *microbatches.shape[1:]), x.dtype), buffer_names)
    recycle = None
    if repeats > 1 and columns > 1:
        recycle = rules_lib.constrain(jnp.zeros((stages, columns - 1, *microbatches.shape[1:]), x.dtype), conveyor_names)
    (_, io, _), _ = jax.lax.scan(iteration, (previous, io, recycle), jnp.arange(schedule.iterations))

    rows, cols = output_slots(schedule)
    outputs = io[rows, cols]
    return rules_lib.constrain(merge_microbatches(outputs), names)


def output_slots(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each microbatch's final output in `io` after the last iteration.

    Microbatch m leaves the last stage in iteration w = (R - 1) M + m + S - 1 into the bottom row
    of column w mod (M / S); every later visit of that column lifts it one row.
    """
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    columns = micro // stages
    m = np.arange(micro)
    written = (repeats - 1) * micro + m + stages - 1
    lifts = (schedule.iterations - 1 - written) // columns
    return stages - 1 - lifts, written % columns


def _by_stage(w: jax.Array, schedule: Schedule, mesh: Mesh, stage_axes: tuple[str, ...]) -> jax.Array:
    """(layers, ...) -> (repeats, stages, layers per stage, ...), the stage dim on the stage axes.

    The other dims keep whatever sharding the parameter has (fsdp, tensor).
    """
    stages, repeats = schedule.stages, schedule.repeats
    w = w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])
    rest = (PartitionSpec.UNCONSTRAINED,) * (w.ndim - 3)
    spec = PartitionSpec(None, stage_axes, None, *rest)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def _along_stages(mask: jax.Array, item_ndim: int) -> jax.Array:
    return mask.reshape(mask.shape[0], *([1] * item_ndim))


def _column(conveyor: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(conveyor, index, axis=1, keepdims=False)


def _set_column(conveyor: jax.Array, index: jax.Array, column: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(conveyor, column, index, axis=1)

