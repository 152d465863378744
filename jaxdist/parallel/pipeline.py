"""Pipeline parallelism: the stacked layers split into stages over the `stage` mesh axis.

A model with a stack of identical layers (a leading `layers` axis on every layer parameter) runs
it through `run_layers`. With a stage axis of size S > 1 in the active mesh, the stack is viewed
as (repeats R, stages S, layers per stage, ...): layer group g = r * S + s runs on stage s, so with
R > 1 the groups go round-robin over the stages (circular / interleaved schedule). The batch is
split into M microbatches that flow through the stages in R * M + S - 1 iterations; every
iteration each stage runs its layers on one microbatch (all stages at once, as a `vmap` whose stage
dim is sharded over the mesh; within a stage the layers run as one call each, as the unrolled model
runs them), then the outputs move one stage on: a roll of the stage dim, which XLA turns into one
collective permute, the only collective of an iteration. The backward pass is autodiff of the
iterations, i.e. GPipe: all forwards, then all backwards. A stage is idle for S - 1 of the
iterations, the bubble (S - 1) / (R * M + S - 1).

The next iteration waits for that roll. With `pipeline.overlap_transfers` a stage's output is
used two iterations after it is made, not one: the roll runs during the iteration in between,
beside its compute, and nothing waits for it unless it takes longer than an iteration (the
backward pass's rolls likewise). The price is S - 1 more idle iterations: a microbatch takes two
iterations a stage, so the bubble is 2 (S - 1) / (R * M + 2 (S - 1)), and with R > 1 a lap needs
M >= 2 S. That pays where the rolls are slow: stages on different hosts (docs/performance.md).

The iterations run unrolled by default (`pipeline.unroll`), a Python loop: a `lax.scan` must copy
what every iteration saves for the backward pass into buffers stacked over the iterations and read
it back, a cost the straight-line program does not have (docs/performance.md); the scan compiles
several times faster. Either way the stages' layers are traced once (a nested jit that every
iteration calls). Each layer's parameters are split from the stack once, before the iterations
(`_layer_groups`), so that each layer's gradient adds up its own iterations.

Outside the pipeline the stage axis splits the batch like the data axes (`rules.from_config` adds
it to the `batch` rule), so the embedding, the final norm, the head and the loss each run on
1 / S of the rows per stage device. Inside, the microbatches keep the batch axes less the stage
axes (`data_parallel_axes`), and the buffers that cross iterations put their stage dim on the
stage axes:

- the inputs: stage 0 reads microbatch t in iteration t from a stage-split buffer whose other
  stages hold zeros, so every read is local. Filling it gathers each row to
  stage 0 once, before the loop; its gradient returns to the rows in one reduction after it.
- the outputs: the last stage's outputs of the last M iterations (each microbatch's final pass)
  go back to the rows' devices after the loop in one reduction over the stage axis (its gradient:
  one gather); unrolled, only those iterations' outputs are kept.
- with R > 1, stage 0 runs microbatch m's next lap M iterations after its previous one, so what
  the roll brings it from the last stage waits M - S iterations (M - 2 S with overlapped
  transfers) in a local delay line (`recycled`, only where that is more than 0).
- riders (`Rider`: per-row arrays the layers read, such as packed rows' segments and positions)
  go through every one of these buffers and rolls beside the activations, so each stage reads
  those of the microbatch it runs.

Bubble iterations compute on zero or stale inputs and their results are never read, so they add
time but no gradient. Layers stay in their canonical order in the parameters; with R > 1 the
stored (contiguous) block of a device is not the round-robin set it runs, so the step regroups
them with one all-to-all over the stage axis (parameters in, gradients out).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import UserError
from jaxdist.parallel import rules as rules_lib
from jaxdist.parallel.rules import STAGE, data_parallel_axes
from jaxdist.parallel.microbatches import merge_microbatches, split_microbatches

if TYPE_CHECKING:
    from jaxdist.config import PipelineConfig



class ApplyLayers(Protocol):
    def __call__(self, x: jax.Array, layers: Any, *, unroll: bool,
                 riders: tuple[jax.Array, ...]) -> tuple[jax.Array, Any]:
        """Runs `layers` on `x`, in order: stacked layers (a leading layer dim on every leaf) as a
        `lax.scan`, or with `unroll` a sequence of per-layer parameter trees, one call each.
        `riders`: per-row arrays that the layers read beside `x` (a packed row's documents). Returns
        the output and the layers' sums over the rows (a tree of arrays with a leading layer dim, such
        as a mixture's token counts), or None."""


class Rider(NamedTuple):
    """A per-row array (its first dim the batch's) that the layers read and do not change: it
    travels through the stages with its microbatch. `names`: its logical axis names."""

    value: jax.Array
    names: tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Sizes of one pipelined pass: S stages, M microbatches, R repeats (circular when R > 1), and
    the iterations from one stage to the next (`hop`: 1, or 2 where the transfers overlap compute)."""

    stages: int
    microbatches: int
    repeats: int = 1
    hop: int = 1

    @property
    def iterations(self) -> int:
        """Iterations: each microbatch passes R * S stage slots; the last stage starts the last
        microbatch hop * (S - 1) iterations after the first stage."""
        return self.repeats * self.microbatches + self.hop * (self.stages - 1)

    @property
    def bubble(self) -> float:
        """Fraction of iterations a stage idles: hop (S - 1) / (R * M + hop (S - 1))."""
        return self.hop * (self.stages - 1) / self.iterations

    @classmethod
    def of(cls, stages: int, settings: PipelineConfig) -> Schedule:
        """The schedule the `pipeline` config section gives on `stages` stages."""
        return cls(stages, settings.microbatches, settings.repeats, 2 if settings.overlap_transfers else 1)

    def check(self, layers: int, rows: int | None = None) -> None:
        """Raises a `UserError` naming the config key if this schedule cannot run `layers` layers
        on batches of `rows` rows per data-parallel batch shard."""
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
        if repeats > 1 and micro < self.hop * stages:
            raise UserError(
                f"pipeline.microbatches={micro} is less than 2 x mesh.stage = {2 * stages}, which "
                f"pipeline.overlap_transfers needs with pipeline.repeats={repeats} (a microbatch takes "
                f"two iterations a stage, so a lap takes {2 * stages}); use at least {2 * stages} "
                f"microbatches, or overlap_transfers=false"
            )
        if rows is not None and rows % micro:
            raise UserError(
                f"pipeline.microbatches={micro} does not divide the {rows} rows each batch shard "
                f"gets per gradient-accumulation step (train.global_batch / the data-parallel batch "
                f"shards, which the stages share / train.microbatches); pick a divisor of {rows}"
            )


def run_layers(
    apply_layers: ApplyLayers,
    layers: Any,
    x: jax.Array,
    settings: PipelineConfig | None,
    names: Sequence[str | None],
    riders: Sequence[Rider] = (),
) -> tuple[jax.Array, Any]:
    """`apply_layers(x, layers)`, pipelined over the stage axis when the active mesh has one: the
    output and the layers' sums over all rows (added up over the microbatches; None if the layers
    have none).

    `layers` is a pytree whose leaves have a leading stacked-layer dim. `names` are the logical
    names of `x`'s dims (the first one the batch). `riders` go to `apply_layers` beside `x`, each
    microbatch's with it. Without active rules, a stage axis or pipeline settings, or when the
    batch does not split into microbatches across its data-parallel shards (e.g. sampling a few
    rows), it runs unpipelined, scanned: the same math, with the layer parameters gathered from
    their stages.
    """
    active = rules_lib.active()
    values = tuple(rider.value for rider in riders)
    if settings is None or active is None:
        return apply_layers(x, layers, unroll=False, riders=values)
    mesh, rules = active
    rules_lib.check_pipeline_buffer(rules, names[0])
    stages = rules_lib.axes_size(mesh, rules.activations[STAGE])
    shards = rules_lib.axes_size(mesh, data_parallel_axes(rules, names[0]))
    if stages == 1 or x.shape[0] % (settings.microbatches * shards):
        return apply_layers(x, layers, unroll=False, riders=values)
    schedule = Schedule.of(stages, settings)
    schedule.check(jax.tree.leaves(layers)[0].shape[0])
    return pipeline(apply_layers, layers, x, schedule, tuple(names), remat=settings.remat, unroll=settings.unroll,
                    riders=riders)


def pipeline(
    apply_layers: ApplyLayers,
    layers: Any,
    x: jax.Array,
    schedule: Schedule,
    names: tuple[str | None, ...],
    remat: bool = False,
    unroll: bool = True,
    riders: Sequence[Rider] = (),
) -> tuple[jax.Array, Any]:
    """The pipelined `apply_layers(x, layers)` and the layers' sums; traced under
    `rules.activation_rules` (see module doc).

    `remat`: each iteration's stages recomputed in the backward pass. `unroll`: the iterations
    unrolled, else one `lax.scan`. `riders` travel with their microbatch as `x` does."""
    mesh, rules = rules_lib.active()
    stage_axes = rules.activations[STAGE]
    weights = jax.tree.map(lambda w: _by_stage(w, schedule, mesh, stage_axes), layers)
    carried = (x, *(rider.value for rider in riders))
    carried_names = (tuple(names), *(tuple(rider.names) for rider in riders))
    with rules_lib.activation_rules(mesh, rules_lib.within_stages(rules, names[0])):
        outputs, sums = _run_iterations(apply_layers, weights, carried, schedule, carried_names, stage_axes, remat,
                                        unroll)
    return rules_lib.constrain(outputs, names), sums


def _run_iterations(apply_layers, weights, carried, schedule, carried_names, stage_axes, remat, unroll):
    """The iterations, under the rules of the inside (the batch less the stage axes): unrolled, a
    Python loop whose iteration numbers are known while tracing, else a `lax.scan`.

    What moves between stages is `carried`, a tuple: the activations first, then the riders, which
    every stage passes on as it got them; each array is handled alike, with its logical names from
    `carried_names`. Returns the activations of the last stage, and the layers' sums added up over
    every real pass (None where the layers have none), in the layers' order."""
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    stage_of = np.arange(stages)
    is_first = tuple(_along_stages(stage_of == 0, part.ndim) for part in carried)
    buffer_names = tuple((STAGE, *names) for names in carried_names)
    stacked_names = tuple((None, *names) for names in buffer_names)
    run_iteration = _iteration_runner(apply_layers, weights, schedule, stage_axes, remat, unroll)
    delay = micro - schedule.hop * stages if repeats > 1 else 0

    def iteration(carry, t, fed_t):
        made, recycled, totals = carry  # the stages' outputs of the last `hop` iterations, oldest first
        # Stage s gets what stage s - 1 made `hop` iterations ago: with hop 2 the roll needs nothing
        # of the last iteration, so it runs beside it.
        shifted = tuple(_to_next_stage(part) for part in made[0])
        first_in = fed_t
        if repeats > 1:
            # The last stage's output, back at stage 0 through the roll, starts its next lap
            # M - hop * S iterations later.
            lap = shifted
            if delay:
                lap = tuple(_slot(line, t % delay) for line in recycled)
                recycled = tuple(_set_slot(line, t % delay, part) for line, part in zip(recycled, shifted))
            first_in = tuple(jnp.where(t < micro, fed_part, lap_part) for fed_part, lap_part in zip(fed_t, lap))
        stage_in = _constrain_each(_select_each(is_first, first_in, shifted), buffer_names)
        out, sums = run_iteration(stage_in, t)
        out = _constrain_each(out, buffer_names)
        if totals is not None:
            totals = _add_real_passes(totals, sums, t, schedule)
        return ((*made[1:], out), recycled, totals), out[0]

    fed, idle, carry = _first_buffers(carried, carried_names, is_first, schedule, delay)
    sums_shape = jax.eval_shape(run_iteration, tuple(part[0] for part in fed), 0)[1]
    totals = jax.tree.map(lambda sums: jnp.zeros((repeats, *sums.shape), sums.dtype), sums_shape)
    carry = (*carry, totals)
    # Microbatch m leaves the last stage for the last time in iteration (R - 1) M + hop (S - 1) + m.
    last = schedule.iterations - micro
    if unroll:
        # Only the outputs read are kept: stacking every iteration's made a buffer of a microbatch
        # per iteration, and as many zero gradients in the backward pass.
        outs = []
        for t in range(schedule.iterations):
            carry, out = iteration(carry, t, tuple(part[t] for part in fed) if t < micro else idle)
            if t >= last:
                outs.append(out)
        outs = jnp.stack(outs)
    else:
        fed = tuple(jnp.concatenate([part, jnp.broadcast_to(zeros, (schedule.iterations - micro, *zeros.shape))])
                    for part, zeros in zip(fed, idle))
        xs = (jnp.arange(schedule.iterations), _constrain_each(fed, stacked_names))
        carry, outs = jax.lax.scan(lambda c, xs: iteration(c, *xs), carry, xs)
        outs = outs[last:]
    # (repeats, stages, layers per stage, ...) is the layers' order (layer group g = r * S + s).
    sums = jax.tree.map(lambda total: total.reshape(-1, *total.shape[3:]), carry[-1])
    is_last = _along_stages(stage_of == stages - 1, carried[0].ndim)
    finished = jnp.where(is_last, rules_lib.constrain(outs, stacked_names[0]), 0)
    # A sum in the activations' dtype (jnp.sum would add in float32, and move float32 between
    # devices): one of its terms is not zero, so it is exact.
    outputs = jax.lax.reduce(finished, jnp.zeros((), carried[0].dtype), jax.lax.add, (1,))
    return merge_microbatches(outputs), sums


def _add_real_passes(totals: Any, sums: Any, t, schedule: Schedule) -> Any:
    """`totals` (repeats, stages, ...) plus each stage's `sums` (stages, ...) of iteration `t`, where
    the stage ran a real pass (not a bubble), into the lap it ran."""
    numbers = np if isinstance(t, int) else jnp
    passed = t - schedule.hop * np.arange(schedule.stages)
    real = (passed >= 0) & (passed < schedule.repeats * schedule.microbatches)
    lap = numbers.clip(passed // schedule.microbatches, 0, schedule.repeats - 1)
    into = (lap[None, :] == np.arange(schedule.repeats)[:, None]) & real[None, :]  # (repeats, stages)

    def add(total, new):
        return total + jnp.where(into.reshape(*into.shape, *([1] * (new.ndim - 1))), new[None], 0)

    return jax.tree.map(add, totals, sums)


def _iteration_runner(apply_layers, weights, schedule, stage_axes, remat, unroll):
    """`run_iteration(stage_in, t) -> (stage_out, sums)`: every stage's layers on its input of
    iteration `t` (the riders passed on as they came), and their sums (stages, layers per stage, ...)."""
    stage_of = np.arange(schedule.stages)
    # A jit of its own: every iteration calls it with the same shapes, so the stages' layers are
    # traced (and differentiated) once, not once per iteration; XLA inlines the calls, so the
    # program is the same.
    run_layers_of_stages = jax.jit(jax.vmap(functools.partial(apply_layers, unroll=True), spmd_axis_name=stage_axes))
    groups = _layer_groups(weights)

    def run_iteration(stage_in: tuple, t) -> tuple:
        # Stage s runs pass t - hop * s; its repeat is which lap of the M microbatches that pass is in.
        numbers = np if isinstance(t, int) else jnp
        repeat = numbers.clip((t - schedule.hop * stage_of) // schedule.microbatches, 0, schedule.repeats - 1)

        def run(stage_in, groups):
            layers = [_pick_by_stage(repeat, [group[i] for group in groups]) for i in range(len(groups[0]))]
            out, sums = run_layers_of_stages(stage_in[0], layers, riders=stage_in[1:])
            return (out, *stage_in[1:]), sums

        if remat:
            # The backward pass keeps only each iteration's stage inputs and recomputes the rest,
            # the weights picked for the iteration (R > 1) included. Unrolled, the recomputation
            # shares one straight-line program with the forward it repeats, and XLA merges the two
            # (keeping the forward's activations after all) unless prevented; a scan's body has
            # nothing to merge it with, and preventing would only cost speed.
            run = jax.checkpoint(run, prevent_cse=unroll)
        return run(stage_in, groups)

    return run_iteration


def _first_buffers(carried, carried_names, is_first, schedule, delay):
    """(stage 0's inputs of the first M iterations, its input once every microbatch is in, the
    loop's first carry: the stages' outputs of the last `hop` iterations, all zeros, and the delay
    line of laps waiting at stage 0, or None)."""
    stages, micro = schedule.stages, schedule.microbatches
    buffer_names = tuple((STAGE, *names) for names in carried_names)
    # (M, rows / M, ...), whole on every stage
    microbatches = tuple(split_microbatches(part, micro) for part in carried)
    fed = _constrain_each(_select_each(is_first, tuple(part[:, None] for part in microbatches), (0,) * len(carried)),
                          tuple((None, *names) for names in buffer_names))
    idle = tuple(jnp.zeros(part.shape[1:], part.dtype) for part in fed)
    nothing_made = _constrain_each(tuple(jnp.zeros((stages, *part.shape[1:]), part.dtype) for part in microbatches),
                                   buffer_names)
    recycled = None
    if delay:
        recycled = tuple(
            rules_lib.constrain(jnp.zeros((stages, delay, *part.shape[1:]), part.dtype), (STAGE, None, *names))
            for part, names in zip(microbatches, carried_names))
    return fed, idle, ((nothing_made,) * schedule.hop, recycled)


def _constrain_each(parts: tuple, names: tuple) -> tuple:
    return tuple(rules_lib.constrain(part, part_names) for part, part_names in zip(parts, names))


def _select_each(where: tuple, if_true: tuple, if_false: tuple) -> tuple:
    return tuple(jnp.where(w, a, b) for w, a, b in zip(where, if_true, if_false))


def _by_stage(w: jax.Array, schedule: Schedule, mesh: Mesh, stage_axes: tuple[str, ...]) -> jax.Array:
    """(layers, ...) -> (repeats, stages, layers per stage, ...), the stage dim on the stage axes.

    The other dims keep whatever sharding the parameter has (fsdp, tensor).
    """
    stages, repeats = schedule.stages, schedule.repeats
    w = w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])
    rest = (PartitionSpec.UNCONSTRAINED,) * (w.ndim - 3)
    spec = PartitionSpec(None, stage_axes, None, *rest)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))


def _layer_groups(weights: Any) -> list[list[Any]]:
    """(repeats, stages, layers per stage, ...) leaves -> groups[r][i]: layer i of repeat r, a tree
    of (stages, ...) leaves.

    Split once, before the loop, so that each layer's gradient adds up its own iterations and the
    gradients are stacked back once. Slicing the stack inside the loop would give each use's
    gradient as a zero-padded copy of the whole stack, added up per iteration.
    """
    leaves, treedef = jax.tree.flatten(weights)
    split = [[_unstack(group, 1) for group in _unstack(w, 0)] for w in leaves]
    repeats, per_stage = leaves[0].shape[0], leaves[0].shape[2]
    return [[treedef.unflatten([leaf[r][i] for leaf in split]) for i in range(per_stage)] for r in range(repeats)]


def _pick_by_stage(repeat, options: list[Any]) -> Any:
    """The tree whose stage s comes from options[repeat[s]]; `repeat` holds one repeat per stage,
    known while tracing (numpy) or not.

    Known, only the repeats some stage runs are read (at most two with M >= hop * S: the stages
    are in one lap or two consecutive ones), so an iteration selects once whatever R is; each option
    read costs a select over the layer's weights, and its gradient a masked copy added up."""
    candidates = [int(r) for r in np.unique(repeat)] if isinstance(repeat, np.ndarray) else range(len(options))
    picked = options[candidates[0]]
    for r in candidates[1:]:
        picked = jax.tree.map(lambda o, p, r=r: jnp.where(_along_stages(repeat == r, o.ndim - 1), o, p),
                              options[r], picked)
    return picked


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unstack(w: jax.Array, axis: int) -> tuple[jax.Array, ...]:
    """The slices of `w` along `axis`; their gradients come back as one stack (a concatenate)."""
    return tuple(jax.lax.index_in_dim(w, i, axis=axis, keepdims=False) for i in range(w.shape[axis]))


def _unstack_fwd(w: jax.Array, axis: int) -> tuple[tuple[jax.Array, ...], None]:
    return _unstack(w, axis), None


def _unstack_bwd(axis: int, _, cotangents: tuple[jax.Array, ...]) -> tuple[jax.Array]:
    return (jnp.stack(cotangents, axis=axis),)


_unstack.defvjp(_unstack_fwd, _unstack_bwd)


@jax.custom_vjp
def _to_next_stage(x: jax.Array) -> jax.Array:
    """Row s moved to row s + 1 (the last to the first): one collective permute over the stage axes.

    Its gradient is the roll back, also one permute (autodiff of `jnp.roll` gives two, each half).
    """
    return jnp.roll(x, 1, axis=0)


def _to_next_stage_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return _to_next_stage(x), None


def _to_next_stage_bwd(_, cotangent: jax.Array) -> tuple[jax.Array]:
    return (jnp.roll(cotangent, -1, axis=0),)


_to_next_stage.defvjp(_to_next_stage_fwd, _to_next_stage_bwd)


def _along_stages(mask: jax.Array, item_ndim: int) -> jax.Array:
    return mask.reshape(mask.shape[0], *([1] * item_ndim))


def _slot(line: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(line, index, axis=1, keepdims=False)


def _set_slot(line: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(line, value, index, axis=1)
