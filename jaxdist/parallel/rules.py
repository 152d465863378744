"""Logical-axis rules: the single place that says which mesh axes each named dimension uses.

Models name their dimensions (`embed`, `mlp`, `heads`, ...); a `Rules` object maps each name to
zero or more mesh axes, separately for parameters (where weights live) and activations (how
intermediate values are split). Data, FSDP and tensor parallelism are presets of these tables:

    from jaxdist.parallel import rules
    my_rules = rules.preset("fsdp_tp").override(params={"experts": "tensor"})
    placement = rules.place(MyModel, my_rules, mesh)   # any flax NNX model; allocates nothing
    placement.shardings, placement.table()

Every spec is checked: a logical name with no rule, a mesh axis used twice in one spec, or a
dimension not divisible by its mesh axes raises a `UserError` naming the parameter. `Rules`
converts to and from flax's `(logical name, mesh axes)` pairs (`to_flax`, `from_flax`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.errors import UserError, warn

MeshAxes = tuple[str, ...]
RuleValue = str | Sequence[str] | None

# Logical names the package itself places by: the batch dim of activations, the stacked-layer dim
# of layer parameters, the stage dim of pipeline buffers, the expert dim of a mixture's experts.
BATCH, LAYERS, STAGE, EXPERTS = "batch", "layers", "stage", "experts"


def _axes(value: RuleValue) -> MeshAxes:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical name -> mesh axes, for parameters and for activations.

    `written_in` says where they were written, so that an error gives its fix in those terms:
    "python" (`create`, a preset, `override`) or "config" (the `rules:` section, `from_config`).
    """

    params: Mapping[str, MeshAxes]
    activations: Mapping[str, MeshAxes]
    written_in: Literal["python", "config"] = dataclasses.field(default="python", compare=False)

    @classmethod
    def create(cls, params: Mapping[str, RuleValue], activations: Mapping[str, RuleValue]) -> Rules:
        """Rules from two tables, logical name -> mesh axis, list of axes, or None (replicated)."""
        return cls(
            params={name: _axes(v) for name, v in params.items()},
            activations={name: _axes(v) for name, v in activations.items()},
        )

    def override(
        self,
        params: Mapping[str, RuleValue] | None = None,
        activations: Mapping[str, RuleValue] | None = None,
    ) -> Rules:
        """A copy with some names remapped or added (None or [] means replicated)."""
        return Rules(
            params={**self.params, **{k: _axes(v) for k, v in (params or {}).items()}},
            activations={**self.activations, **{k: _axes(v) for k, v in (activations or {}).items()}},
            written_in=self.written_in,
        )

    def to_flax(self, kind: str = "params") -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The `params` or `activations` table as flax's logical axis rules: `(name, mesh axes)` pairs
        for `nnx.logical_axis_rules`, `flax.linen.logical_axis_rules` or `logical_to_mesh_axes`."""
        table = {"params": self.params, "activations": self.activations}[kind]
        return tuple((name, spec_entry(axes)) for name, axes in table.items())

    @classmethod
    def from_flax(cls, params: Sequence[tuple[str, RuleValue]], activations: Sequence[tuple[str, RuleValue]] | None = None) -> Rules:
        """Rules from flax-style `(logical name, mesh axes)` pairs (activations default to the params').

        Where flax lists a name more than once, its first pair wins, as flax takes the first rule
        that applies.
        """
        def table(pairs):
            first: dict[str, RuleValue] = {}
            for name, axes in pairs:
                first.setdefault(name, axes)
            return first

        return cls.create(table(params), table(params if activations is None else activations))

    def param_spec(self, names: Sequence[str | None], where: str = "a parameter") -> PartitionSpec:
        """The PartitionSpec of a parameter whose dimensions carry logical `names` (None: not split);
        a `UserError` naming `where` for a name without a rule or a mesh axis used twice."""
        return self._spec("params", names, where)

    def activation_spec(self, names: Sequence[str | None], where: str = "an activation") -> PartitionSpec:
        """As `param_spec`, by the activation rules."""
        return self._spec("activations", names, where)

    def rule_name(self, kind: str, name: str) -> str:
        """How the user wrote (or writes) the `kind` ("params", "activations") rule of `name`."""
        return f"rules.{kind}.{name}" if self.written_in == "config" else f"the {kind} rule of '{name}'"

    def _spec(self, kind: str, names: Sequence[str | None], where: str) -> PartitionSpec:
        table: Mapping[str, MeshAxes] = getattr(self, kind)
        entries, used = [], {}
        for name in names:
            if name is None:
                entries.append(None)
                continue
            if name not in table:
                raise UserError(f"rules: {where} uses logical axis '{name}', which has no rule; {self._add(kind, name)}")
            axes = table[name]
            for axis in axes:
                if axis in used:
                    raise UserError(
                        f"rules: {where} maps both '{used[axis]}' and '{name}' to mesh axis '{axis}'; a mesh axis "
                        f"can split only one dimension: {self._change(kind, name, used[axis])}")
                used[axis] = name
            entries.append(spec_entry(axes))
        return PartitionSpec(*entries)

    def _add(self, kind: str, name: str) -> str:
        """How to give `name` a rule. Config files remap only the presets' names (`_check_names`), so
        a name no preset has gets its rule in Python whichever way the rules were written."""
        add = f"give it one with .override({kind}={{{name!r}: None}}) (replicated) or a mesh axis in place of None"
        if self.written_in == "config":
            return (f"no preset has one and config files remap only the presets' names: place this model from "
                    f"Python (jaxdist.Trainer, rules.place) and {add}")
        return add

    def _change(self, kind: str, name: str, other: str) -> str:
        if self.written_in == "config":
            return f"change rules.{kind}.{name} or rules.{kind}.{other}"
        return f"change the rule of '{name}' or of '{other}' with .override({kind}={{...}})"


def spec_axes(entry: Any) -> MeshAxes:
    """The mesh axes one PartitionSpec entry names: None -> (), "a" -> ("a",), ("a", "b") as is."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry naming `axes`: () -> None, ("a",) -> "a", ("a", "b") as is (`spec_axes` inverted)."""
    return axes[0] if len(axes) == 1 else (tuple(axes) or None)


def spec_without(spec: PartitionSpec, axes: Sequence[str]) -> PartitionSpec:
    """`spec` with the mesh axes `axes` taken out of every entry (those dimensions no longer split by them)."""
    return PartitionSpec(*(spec_entry([axis for axis in spec_axes(entry) if axis not in axes]) for entry in spec))


def axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """How many ways `axes` of `mesh` split a dimension together: the product of their sizes."""
    return math.prod(mesh.shape[axis] for axis in axes)


def padded_spec(spec: PartitionSpec, rank: int) -> PartitionSpec:
    """`spec` with one entry per dimension of a rank-`rank` array (trailing entries None)."""
    return PartitionSpec(*spec, *([None] * (rank - len(spec))))


def batch_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes the batch is split over (the activation rule for `batch`)."""
    return tuple(rules.activations.get(BATCH, ()))


def data_parallel_axes(rules: Rules, name: str = BATCH) -> tuple[str, ...]:
    """The mesh axes of the `name` activation rule less the stage axes.

    Along these every device runs the whole model on its own rows: the pipeline's microbatches are
    split over them, and a device's gradients over its rows are complete along them (the stages
    split the rows of the embedding, head and loss, but each stage's layer gradients sum them all).
    """
    stage = set(rules.activations.get(STAGE, ()))
    return tuple(axis for axis in rules.activations.get(name, ()) if axis not in stage)


def shard_axes(rules: Rules) -> tuple[str, ...]:
    """The data-parallel axes less the experts' (`experts` parameter rule): along these a batch
    shard's gradients can be computed alone. The experts' axes split the batch too, but their
    devices exchange tokens in every MoE layer, so they are one shard together."""
    experts = set(rules.params.get(EXPERTS, ()))
    return tuple(axis for axis in data_parallel_axes(rules) if axis not in experts)


def within_stages(rules: Rules, batch: str = BATCH) -> Rules:
    """The rules inside a pipeline: the batch less the stage axes (a UserError if it has no rule)."""
    rules.activation_spec((batch,), "the pipelined activations")
    return rules.override(activations={batch: data_parallel_axes(rules, batch)})


def check_pipeline_buffer(rules: Rules, batch: str = BATCH) -> None:
    """The `UserError` a pipeline buffer's spec (stage, batch) raises under `rules`, if any: a rule
    missing, or both dims on one mesh axis."""
    within_stages(rules, batch).activation_spec((STAGE, batch), "a pipeline buffer")


def check_divisible(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, where: str) -> None:
    """Raises if a dimension is not divisible by the product of its mesh axes."""
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        axes = spec_axes(entry)
        unknown = [axis for axis in axes if axis not in mesh.shape]
        if unknown:
            raise UserError(f"rules: {where} names mesh axis '{unknown[0]}', which the mesh does not have")
        parts = axes_size(mesh, axes)
        if size % parts:
            split = " x ".join(f"{axis}={mesh.shape[axis]}" for axis in axes)
            raise UserError(
                f"rules: {where} dim {dim} (size {size}) is not divisible by {split}; change the "
                f"mesh or the rule for that dimension"
            )


def check_mesh_axes(rules: Rules, mesh: Mesh) -> None:
    """Every mesh axis named by a rule exists in the mesh."""
    for kind in ("params", "activations"):
        for name, axes in getattr(rules, kind).items():
            for axis in axes:
                if axis not in mesh.shape:
                    raise UserError(f"rules: {rules.rule_name(kind, name)} names mesh axis '{axis}'; the mesh axes "
                                    f"are {', '.join(mesh.shape)}")


# Transformers name `embed`, `mlp`, `heads`, ... (`kv_heads`: grouped-query attention's key and value
# heads, split over tensor as the query heads are; `latent`: latent attention's latents, small and
# kept whole); image classifiers add `classes` (logits), the
# convolution kernels' `kernel_h`, `kernel_w`, `conv_in`, `conv_out` (BatchNorm's scale, offset and
# statistics are per `conv_out` channel) and feature maps' `height`, `width`, `channels`.
_COMMON_PARAMS: dict[str, RuleValue] = {
    "layers": None, "vocab": None, "embed": None, "mlp": None, "heads": None, "kv_heads": None,
    "head_dim": None, "length": None, "qkv": None, "experts": "expert", "expert_mlp": None, "latent": None,
    "classes": None, "kernel_h": None, "kernel_w": None, "conv_in": None, "conv_out": None,
}
_COMMON_ACTIVATIONS: dict[str, RuleValue] = {
    "batch": ["data", "fsdp"], "seq": None, "length": None, "embed": None, "mlp": None, "heads": None,
    "kv_heads": None, "head_dim": None, "vocab": None, "stage": "stage",
    "classes": None, "height": None, "width": None, "channels": None,
}
# A convolution's output channels: the dimension every kernel has in a size the mesh can split (a
# first layer's input channels are often 3).
_FSDP_PARAMS: dict[str, RuleValue] = {"embed": "fsdp", "conv_out": "fsdp"}
# Column-parallel convolutions: each device computes its slice of the output channels (and their
# BatchNorm, which needs no other device's channels) from all input channels.
_TP_PARAMS: dict[str, RuleValue] = {
    "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor", "conv_out": "tensor",
    "expert_mlp": "tensor"}
_TP_ACTIVATIONS: dict[str, RuleValue] = {
    "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor", "channels": "tensor"}
# Both: output channels split over tensor first, so that gathering a kernel over fsdp yields the
# contiguous slice of channels the device's tensor rank computes.
_FSDP_TP_PARAMS: dict[str, RuleValue] = {"conv_out": ["tensor", "fsdp"]}

PRESETS: dict[str, Rules] = {
    # Replicated weights; the batch is split over data (and fsdp, if that axis is used).
    "dp": Rules.create(_COMMON_PARAMS, _COMMON_ACTIVATIONS),
    # Weights split along `embed` over fsdp (ZeRO-3); gathered per layer by XLA.
    "fsdp": Rules.create({**_COMMON_PARAMS, **_FSDP_PARAMS}, _COMMON_ACTIVATIONS),
    # Megatron: attention heads and the MLP hidden split over tensor (column, then row parallel).
    "tp": Rules.create({**_COMMON_PARAMS, **_TP_PARAMS}, {**_COMMON_ACTIVATIONS, **_TP_ACTIVATIONS}),
    "fsdp_tp": Rules.create(
        {**_COMMON_PARAMS, **_FSDP_PARAMS, **_TP_PARAMS, **_FSDP_TP_PARAMS}, {**_COMMON_ACTIVATIONS, **_TP_ACTIVATIONS}
    ),
}


def preset(name: str) -> Rules:
    """One of the named presets: dp, fsdp, tp, fsdp_tp."""
    if name not in PRESETS:
        raise UserError(f"rules.preset={name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def from_config(rules_cfg, mesh_shape: Mapping[str, int] | None = None) -> Rules:
    """Rules from the `rules:` config section (a preset plus YAML overrides); a `UserError` for an
    override of a logical name that no preset has.

    With an expert axis in `mesh_shape` the batch is split over it too (after the data axes): each
    expert device routes its own tokens. With a stage axis, the `layers` dim of parameters is split
    over it and the batch over it too, outside the pipeline (innermost, after the data axes). An
    explicit rule in the config wins: `rules.params.layers: null` keeps every layer on every stage
    (more memory, no regrouping); a `rules.activations.batch` without the stage axis runs the
    embedding, head and loss on every row on every stage.
    """
    _check_names("params", "a parameter", rules_cfg.params)
    _check_names("activations", "an activation", rules_cfg.activations)
    rules = dataclasses.replace(preset(rules_cfg.preset), written_in="config").override(
        rules_cfg.params, rules_cfg.activations)
    if mesh_shape is not None and mesh_shape.get("expert", 1) > 1 and BATCH not in rules_cfg.activations:
        rules = rules.override(activations={BATCH: [*rules.activations.get(BATCH, ()), "expert"]})
    if mesh_shape is None or mesh_shape.get(STAGE, 1) == 1:
        return rules
    if LAYERS not in rules_cfg.params:
        rules = rules.override(params={LAYERS: STAGE})
    if BATCH not in rules_cfg.activations:
        stage = rules.activations.get(STAGE, ())
        rules = rules.override(activations={BATCH: [*data_parallel_axes(rules), *stage]})
    return rules


def _check_names(kind: str, what: str, overrides: Mapping[str, RuleValue]) -> None:
    # Checked against the presets' names, not the configured model's: activation names show only
    # when the step is traced (too late to fail before compiling), and every name jaxdist's models
    # use has a rule in every preset, since placing a model fails on a name without one. So a name
    # outside the presets is a typo, which as an override would do nothing; a model with a new
    # name adds its rule to the presets (Rules.override still takes any name, from Python).
    names = list(dict.fromkeys(name for rules in PRESETS.values() for name in getattr(rules, kind)))
    for name, value in overrides.items():
        if name not in names:
            raise UserError(f"rules: rules.{kind}.{name}={rule_text(value)}: '{name}' is not a logical name of "
                            f"{what}; the names are {', '.join(names)}")


def rule_text(value: RuleValue) -> str:
    """A rule's mesh axes as the config writes them: tensor, [data, fsdp], null."""
    if value is None:
        return "null"
    return value if isinstance(value, str) else f"[{', '.join(value)}]"


# -- activation constraints ------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("jaxdist_rules", default=None)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Makes `constrain` use these rules while a step is traced."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the enclosing `activation_rules`, or None outside one."""
    return _ACTIVE.get()


def sharded_activation(names: Sequence[str | None]) -> tuple[Mesh, PartitionSpec] | None:
    """(mesh, the activation's spec padded to `names`) under `activation_rules` over several
    devices; None otherwise. For kernels that run per shard with `shard_map`."""
    active = _ACTIVE.get()
    if active is None or active[0].size == 1:
        return None
    mesh, rules = active
    return mesh, padded_spec(rules.activation_spec(names), len(names))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by logical names; a no-op outside `activation_rules`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = rules.activation_spec(names)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# -- parameter shardings ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter's placement, as the sharding table prints it."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    names: tuple[str | None, ...]
    spec: PartitionSpec
    shard_shape: tuple[int, ...]

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * jax.numpy.dtype(self.dtype).itemsize


_SHARDING_METADATA = ("out_sharding", "sharding_names", "sharding")


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names a flax variable was annotated with (`nnx.with_partitioning`,
    `out_sharding=`); all None (replicated) for a variable without any."""
    metadata = variable.get_metadata()
    for key in _SHARDING_METADATA:
        names = metadata.get(key)
        if names is not None:
            return tuple(names)
    return (None,) * len(variable.shape)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def unnamed(variables: nnx.State) -> tuple[str, ...]:
    """The paths of the variables that carry no logical names (and have a dimension to split): no
    rule reaches them, so they are replicated on every device."""
    return tuple("/".join(map(str, path)) for path, variable in nnx.to_flat_state(variables)
                 if variable.shape and not any(variable.get_metadata().get(key) is not None
                                               for key in _SHARDING_METADATA))


# The sets of unnamed parameters this process has warned about: a model placed again (a Trainer after
# rules.place, another Trainer, each layout `jaxdist plan` tries) is not warned about again.
_WARNED_UNNAMED: set[tuple[str, ...]] = set()


def warn_unnamed(paths: Sequence[str]) -> None:
    """One warning naming the parameters without logical names (replicated: legal, but perhaps
    not meant), if there are any and this process has not yet warned about these."""
    paths = tuple(paths)
    if paths and paths not in _WARNED_UNNAMED:
        _WARNED_UNNAMED.add(paths)
        shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
        warn(f"rules: {len(paths)} parameter(s) carry no logical names, so every device holds them whole: "
             f"{shown}; name their dimensions (nnx.with_partitioning) for the rules to split them")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every parameter of a model lives: checked layouts, their shardings and a table.

    `layouts` and `shardings` mirror the placed tree (for a flax NNX model, its `nnx.state`); a
    tree of shardings also serves as a prefix of the state's own tree, e.g. as `out_shardings` of
    a jitted init. `graphdef` is the model's graph definition and `factory` its factory, where a
    model or factory was placed.
    """

    layouts: Any
    mesh: Mesh
    graphdef: nnx.GraphDef | None = None
    factory: Callable[[nnx.Rngs], nnx.Module] | None = None

    @property
    def shardings(self) -> Any:
        """The model's parameters' NamedShardings, a pytree shaped like its state."""
        return layout_shardings(self.layouts, self.mesh)

    def table(self) -> str:
        """Each parameter's path, shape, logical names, mesh spec and bytes per device, as text."""
        return sharding_table(self.layouts)

    def create(self, seed: int = 0) -> nnx.Module:
        """The placed model built for real, born sharded: each device creates only its own shards."""
        if self.factory is None:
            raise ValueError("create() builds a model from its factory: place the model class or factory")

        def init():
            with nnx.use_eager_sharding(False):  # the rules place the variables, not their names
                return nnx.state(self.factory(nnx.Rngs(seed)))

        return nnx.merge(self.graphdef, jax.jit(init, out_shardings=self.shardings)())


def place(target: Any, rules: Rules, mesh: Mesh, names: Any = None) -> Placement:
    """The checked placement of `target`'s parameters under `rules` on `mesh`; allocates nothing.

    `target`: a flax NNX model class or factory called as `target(rngs)` (built abstractly), an
    `nnx.Module`, or an `nnx.State`, all carrying logical names as variable metadata; or any pytree
    of arrays or `jax.ShapeDtypeStruct`s, with `names` a matching pytree of logical-name tuples.
    A variable without logical names is replicated, with one warning naming every such variable.
    """
    graphdef = factory = None
    if names is None:
        if callable(target) and not isinstance(target, nnx.Module):
            factory = target
            with nnx.use_eager_sharding(False):
                target = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
        if isinstance(target, nnx.Module):
            graphdef, target = nnx.split(target)
        warn_unnamed(unnamed(target))
        names = jax.tree.map(logical_names, target, is_leaf=_is_variable)
        target = jax.tree.map(lambda v: v.get_value(), target, is_leaf=_is_variable)
    return Placement(param_layouts(target, names, rules, mesh), mesh, graphdef, factory)


def param_layouts(abstract_params: Any, logical_names: Any, rules: Rules, mesh: Mesh) -> Any:
    """A tree of `ParamLayout`, checked against the rules and the mesh."""
    check_mesh_axes(rules, mesh)

    def layout(path, leaf, names):
        where = f"parameter {path_str(path)}"
        if len(names) != len(leaf.shape):
            raise UserError(f"rules: {where} has shape {leaf.shape} but {len(names)} logical names {names}")
        spec = rules.param_spec(names, where)
        check_divisible(spec, leaf.shape, mesh, where)
        shard = NamedSharding(mesh, spec).shard_shape(leaf.shape)
        return ParamLayout(path_str(path), tuple(leaf.shape), leaf.dtype, tuple(names), spec, tuple(shard))

    return jax.tree.map_with_path(layout, abstract_params, logical_names, is_leaf=_is_names)


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def layout_shardings(layouts: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda lay: NamedSharding(mesh, lay.spec), layouts, is_leaf=_is_layout)


def _is_layout(x: Any) -> bool:
    return isinstance(x, ParamLayout)


def path_str(path: Sequence[Any]) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def sharding_table(layouts: Any) -> str:
    """Each parameter's path, shape, logical names, mesh spec and bytes per device, as text."""
    rows = [
        (lay.path, "x".join(map(str, lay.shape)), _names_str(lay.names), _spec_str(lay.spec),
         f"{lay.bytes_per_device:,}")
        for lay in jax.tree.leaves(layouts, is_leaf=_is_layout)
    ]
    header = ("parameter", "shape", "logical", "mesh spec", "bytes/device")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    total = sum(lay.bytes_per_device for lay in jax.tree.leaves(layouts, is_leaf=_is_layout))
    lines.append(f"total parameter bytes per device: {total:,}")
    return "\n".join(lines)


def _names_str(names: Sequence[str | None]) -> str:
    return "(" + ", ".join(str(n) for n in names) + ")"


def _spec_str(spec: PartitionSpec) -> str:
    parts = []
    for entry in spec:
        axes = spec_axes(entry)
        parts.append("+".join(axes) if axes else "-")
    return "(" + ", ".join(parts) + ")"
