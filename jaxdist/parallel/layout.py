"""A config's layout on the devices at hand: the mesh, the rules, the batch sharding, checked.

Everything here runs before anything compiles, so a layout the devices or the data cannot carry
is a `UserError` naming the config key. The batch axes come from the rules (`activations.batch`),
the one place that says how the batch is split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxdist.config import Config, ParamSize
from jaxdist.errors import UserError
from jaxdist.parallel import feed, pipeline
from jaxdist.parallel import mesh as mesh_lib
from jaxdist.parallel import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class Layout:
    """The mesh and the rules a config runs under."""

    mesh: Mesh
    rules: rules_lib.Rules

    @property
    def batch_sharding(self) -> NamedSharding:
        """Sharding of every batch array: the leading (example) dim split as the `batch` rule says."""
        return feed.batch_sharding(self.mesh, self.rules)

    @property
    def batch_shards(self) -> int:
        """How many distinct parts the batch rule splits a global batch into."""
        return rules_lib.axes_size(self.mesh, rules_lib.batch_axes(self.rules))

    def pipeline_rows(self, global_batch: int, microbatches: int) -> int:
        """Rows each data-parallel batch shard gets per accumulation step (of `microbatches`): what a
        pipeline splits into its microbatches, the stage and tensor devices sharing them whole."""
        return global_batch // rules_lib.axes_size(self.mesh, rules_lib.data_parallel_axes(self.rules)) // microbatches

    def process_rows(self, global_batch: int, process_index: int | None = None) -> feed.BatchRows:
        """The rows of each global batch that a process (default: this one) feeds."""
        return feed.process_rows(self.batch_sharding, global_batch, process_index)


def from_config(cfg: Config, devices: list | None = None, activations: Sequence[tuple[str, ...]] = ()) -> Layout:
    """The checked layout of `cfg` on `devices` (default: all devices of all processes).

    `activations`: the logical names of the model's activations (`ModelEntry.activations`, which
    the layers above pass in), so that rules their specs would refuse stop the run before it starts.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_lib.resolve_mesh_shape(cfg.mesh, len(devices))
    mesh = mesh_lib.build_mesh(shape, devices)
    layout = Layout(mesh, rules_lib.from_config(cfg.rules, shape))
    rules_lib.check_mesh_axes(layout.rules, mesh)
    check(cfg, layout, activations)
    return layout


def check(cfg: Config, layout: Layout, activations: Sequence[tuple[str, ...]] = ()) -> None:
    """The checks that need the mesh: every mesh axis of more than one device used by a rule, batch sizes
    against the batch shards, the sizes the model's keys give its parameters against the mesh axes their
    rules split them over."""
    _check_axes_used(cfg, layout)
    shards = layout.batch_shards
    axes = " x ".join(f"mesh.{axis}" for axis in rules_lib.batch_axes(layout.rules)) or "nothing (replicated)"
    if cfg.train.global_batch % shards:
        raise UserError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by the {shards} batch shards "
            f"(the batch is split over {axes}); use a multiple of {shards}"
        )
    per_shard = cfg.train.global_batch // shards
    if per_shard % cfg.train.microbatches:
        raise UserError(
            f"train.microbatches={cfg.train.microbatches} does not divide the per-device batch "
            f"{per_shard} (train.global_batch / {shards} batch shards); pick a divisor of {per_shard}"
        )
    # Before the parameters are placed, whose check would name a parameter (blocks/attn/out), not the key.
    for size in cfg.model.param_sizes():
        axes = layout.rules.params.get(size.name, ())
        if size.size % rules_lib.axes_size(layout.mesh, axes):
            raise UserError(_not_divisible(cfg, layout, size, axes))
    _check_pipeline(cfg, layout)
    _check_experts(cfg, layout)
    _check_sequence_split(cfg, layout)
    _check_activations(cfg, layout.rules, activations)


def _check_experts(cfg: Config, layout: Layout) -> None:
    """An expert axis splits a mixture's experts: a model without any has nothing for it; and the
    experts' rule names axes the mesh has (`rules.params.experts`)."""
    size = layout.mesh.shape["expert"]
    moe = getattr(cfg.model, "moe", None)
    if size > 1 and (moe is None or not moe.experts):
        has = "model.moe.experts=0" if moe is not None else f"model.name={cfg.model.name} has no experts"
        raise UserError(f"mesh.expert={size} splits a mixture's experts, and {has}; set mesh.expert=1, or give the "
                        f"model experts (model.moe.experts)")
    if size > 1 and "expert" not in layout.rules.params.get(rules_lib.EXPERTS, ()):
        raise UserError(f"mesh.expert={size}, but rules.params.experts does not name mesh axis 'expert', so its "
                        f"devices would each hold every expert; leave rules.params.experts to the preset")
    shards = rules_lib.axes_size(layout.mesh, rules_lib.shard_axes(layout.rules))
    train = cfg.train
    vmapped = train.grad_compression != "none" or (train.microbatches > 1 and train.grad_reduction == "per_step")
    if moe is not None and moe.experts and shards > 1 and vmapped:
        why, fix = (("train.grad_compression", "train.grad_compression=none") if train.grad_compression != "none"
                    else ("train.microbatches > 1 with train.grad_reduction=per_step",
                          "train.grad_reduction=per_microbatch (reduced each microbatch; the same math)"))
        raise UserError(f"model.moe.experts={moe.experts}: {why} computes each of the {shards} batch shards' gradients "
                        f"apart, in a vmap, and the experts' grouped matmuls (jax.lax.ragged_dot) cannot be vmapped; "
                        f"set {fix}")
    if moe is not None and moe.capacity_factor is not None:
        split = [name for name in ("seq", "length")
                 if rules_lib.axes_size(layout.mesh, layout.rules.activations.get(name, ())) > 1]
        if split or layout.mesh.shape["stage"] > 1:
            where = (f"rules.activations.{split[0]} splits each sequence" if split
                     else "mesh.stage > 1 runs microbatches")
            raise UserError(f"model.moe.capacity_factor={moe.capacity_factor} takes each expert's first assignments in "
                            f"token order, which {where} would change; drop model.moe.capacity_factor (dropless)")


def _check_sequence_split(cfg: Config, layout: Layout) -> None:
    """Sequences split over mesh axes (sequence or context parallelism) split into equal chunks."""
    seq_len = getattr(cfg.model, "seq_len", None)
    for name in ("seq", "length"):
        axes = layout.rules.activations.get(name, ())
        parts = rules_lib.axes_size(layout.mesh, axes)
        if seq_len and seq_len % parts:
            split = " x ".join(f"mesh.{axis}={layout.mesh.shape[axis]}" for axis in axes)
            raise UserError(f"model.seq_len={seq_len} is not divisible by {split}, over which rules.activations."
                            f"{name} splits each sequence; use a multiple of {parts}")


def _check_pipeline(cfg: Config, layout: Layout) -> None:
    """A pipeline's stack of layers, its schedule and its microbatches against the config."""
    stages = layout.mesh.shape["stage"]
    if stages == 1:
        return
    if cfg.model.layer_stack is None:
        raise UserError(
            f"mesh.stage={stages} pipelines a stack of identical layers, and model.name={cfg.model.name} "
            f"has none; use mesh.stage=1"
        )
    if not cfg.model.stacked_layers:
        raise UserError(
            f"mesh.stage={stages} pipelines the stacked layer stack, but model.impl.scan_layers=false "
            f"gives each layer its own parameters; set model.impl.scan_layers=true"
        )
    rows = layout.pipeline_rows(cfg.train.global_batch, cfg.train.microbatches)
    pipeline.Schedule.of(stages, cfg.pipeline).check(cfg.model.layer_stack, rows)


# What makes each mesh axis do its part, for the error about an axis no rule uses.
_USE_AXIS = {
    "data": "split the batch over it (rules.activations.batch with data)",
    "stage": "pipeline over it (rules.activations.stage: stage)",
    "fsdp": "use rules.preset=fsdp / fsdp_tp, which split weights over fsdp",
    "expert": "give the model experts (model.moe.experts), which every preset splits over expert",
    "tensor": "use rules.preset=tp / fsdp_tp, which split weights over tensor",
}


def _check_axes_used(cfg: Config, layout: Layout) -> None:
    """A mesh axis of more than one device that no rule names splits nothing: its devices would each
    repeat the same work on the same data."""
    named = {axis for table in (layout.rules.params, layout.rules.activations) for axes in table.values()
             for axis in axes}
    for axis, size in layout.mesh.shape.items():
        if size > 1 and axis not in named:
            rules = ", ".join([f"rules.preset={cfg.rules.preset}",
                               *(f"rules.{kind}.{name}={rules_lib.rule_text(value)}"
                                 for kind in ("params", "activations")
                                 for name, value in getattr(cfg.rules, kind).items())])
            raise UserError(
                f"mesh.{axis}={size}, but no parameter or activation rule of {rules} uses mesh axis '{axis}', so "
                f"its {size} devices would each repeat the same work; set mesh.{axis}=1, or {_USE_AXIS[axis]}"
            )


def _check_activations(cfg: Config, rules: rules_lib.Rules, activations: Sequence[tuple[str, ...]]) -> None:
    """The errors the activations' specs would raise only as the step is traced, after the run has begun:
    the batch's, the model's activations' and the pipeline's buffers' under these rules."""
    for names in [(rules_lib.BATCH,), *activations]:
        rules.activation_spec(names, f"an activation ({', '.join(map(str, names))})")
    if cfg.model.stacked_layers and cfg.model.layer_stack is not None:
        rules_lib.check_pipeline_buffer(rules)


def _not_divisible(cfg: Config, layout: Layout, size: ParamSize, axes: tuple[str, ...]) -> str:
    """The error for a model size that `axes` cannot split: the key, the axes and the rule that splits it."""
    parts = rules_lib.axes_size(layout.mesh, axes)
    split = " x ".join(f"mesh.{axis}={layout.mesh.shape[axis]}" for axis in axes)
    if len(axes) > 1:
        split += f" = {parts}"
    rule = (f"rules.params.{size.name}={rules_lib.rule_text(cfg.rules.params[size.name])}"
            if size.name in cfg.rules.params else f"rules.preset={cfg.rules.preset}")
    over = f"{split}, over which {rule} splits {size.name}"
    if size.size == size.value:
        return f"{size.key}={size.value} is not divisible by {over}, {size.what}; use a multiple of {parts}"
    return (f"{size.key}={size.value} makes {size.what} = {size.size}, which is not divisible by {over}; pick a "
            f"{size.key} that makes it a multiple of {parts}")
