"""The train state, born sharded.

The model is first built abstractly (`nnx.eval_shape`: shapes and logical names, no memory);
the rules turn the names into shardings; then one jitted init with `out_shardings` creates the
parameters directly in place, and a second creates the optimizer state with shardings derived
from the parameters'. No full copy of either ever sits on one device or host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.parallel import roles as roles_lib
from jaxdist.parallel import rules as rules_lib
from jaxdist.train.options import InitOptions, StepLayout, StepOptions
from jaxdist.train.precision import LossScale
from jaxdist.train.spikes import LossStats

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


class TrainState(flax.struct.PyTreeNode):
    """Everything one optimizer step reads and writes: a pytree of (sharded) arrays.

    `skipped_steps` counts the steps whose update was dropped (non-finite loss or gradients, see
    `precision.verdict`): the optimizer has taken `step - skipped_steps` steps. `loss_scale` is the
    dynamic loss-scale state (`precision.LossScale`) under float16, else None. `model_state` holds
    the model's variables that are not parameters (BatchNorm's running averages), updated by the
    step's forward pass, not by the optimizer; None for a model without any (the GPT).
    `loss_stats`: the running average of the applied steps' losses, which the loss-spike guard
    compares each loss with (`spikes.LossStats`). `compression`: the compressed gradient
    reduction's error feedback (`parallel.compression.CompressionState`), else None.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    skipped_steps: jax.Array
    loss_scale: LossScale | None = None
    model_state: Any = None
    loss_stats: LossStats | None = None
    compression: Any = None


class AbstractModel(NamedTuple):
    """A model described without memory: its graph, abstract parameters and other variables (pure
    dicts of `jax.ShapeDtypeStruct`s), the logical names of each and the parameters' roles
    (`parallel.roles`: weight, bias, norm, embedding)."""

    graphdef: nnx.GraphDef
    params: Any
    names: Any
    roles: Any
    state: Any = None  # the non-parameter variables (`TrainState.model_state`); None without any
    state_names: Any = None
    unnamed: tuple[str, ...] = ()  # the paths of the variables without logical names (`rules.unnamed`)


def _names(variables: nnx.State) -> Any:
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.to_pure_dict(jax.tree.map(rules_lib.logical_names, variables, is_leaf=is_var))


def _or_none(variables: Any) -> Any:
    return variables if jax.tree.leaves(variables) else None


def abstract_model(create_model: ModelFactory, seed: int) -> AbstractModel:
    """The model's `AbstractModel`, allocating nothing."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: create_model(nnx.Rngs(seed)))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    state_dict = _or_none(nnx.to_pure_dict(state))
    return AbstractModel(graphdef, nnx.to_pure_dict(params), _names(params), roles_lib.roles(params), state_dict,
                         None if state_dict is None else _names(state), rules_lib.unnamed(nnx.state(model)))


def model_variables(create_model: ModelFactory, seed: int) -> tuple[Any, Any]:
    """Builds the model for real: (its parameters, its other variables or None) as pure dicts (run under jit)."""
    with nnx.use_eager_sharding(False):
        model = create_model(nnx.Rngs(seed))
    _, params, state = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), _or_none(nnx.to_pure_dict(state))


def param_dict(create_model: ModelFactory, seed: int) -> Any:
    """Builds the model for real and returns its parameters as a pure dict (run under jit)."""
    return model_variables(create_model, seed)[0]


def merge(graphdef: nnx.GraphDef, params: Any, model_state: Any = None) -> nnx.Module:
    """The model from its graph, parameters and (where it has any) other variables."""
    return nnx.merge(graphdef, params) if model_state is None else nnx.merge(graphdef, params, model_state)


def model_state_of(model: nnx.Module, model_state: Any) -> Any:
    """The model's non-parameter variables as a pure dict after a forward pass (None where
    `model_state` was None: a model without any)."""
    return None if model_state is None else nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def opt_state_shardings(tx: optax.GradientTransformation, abstract_params: Any, param_shardings: Any, mesh: Mesh):
    """Optimizer-state shardings that follow the parameters' (optax alone would replicate them).

    State shaped unlike its parameter (adafactor's factored row and column statistics) is small
    and replicated; leaves a mask left out (`optax.MaskedNode`) stay as they are.
    """
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    replicated = NamedSharding(mesh, PartitionSpec())

    def follow(leaf, param, sharding):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return sharding if leaf.shape == param.shape else replicated

    return optax.tree_map_params(
        tx, follow, abstract_opt, abstract_params, param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )


def param_shardings(abstract: AbstractModel, rules: rules_lib.Rules, mesh: Mesh) -> Any:
    """Each parameter's sharding as `init_state` places it: its logical names under `rules` on `mesh`."""
    return rules_lib.layout_shardings(rules_lib.param_layouts(abstract.params, abstract.names, rules, mesh), mesh)


def model_state_shardings(abstract: AbstractModel, rules: rules_lib.Rules, mesh: Mesh) -> Any:
    """The sharding of each of the model's other variables (None: it has none), placed by the
    parameter rules as the parameters they belong to."""
    if abstract.state is None:
        return None
    return rules_lib.layout_shardings(rules_lib.param_layouts(abstract.state, abstract.state_names, rules, mesh), mesh)


def init_state(
    create_model: ModelFactory,
    tx: optax.GradientTransformation,
    layout: StepLayout,
    init: InitOptions = InitOptions(),
    options: StepOptions = StepOptions(),
) -> tuple[TrainState, TrainState, nnx.GraphDef, Any]:
    """Creates the sharded train state on `layout`'s mesh; returns (state, state shardings, graphdef, layouts).

    `init` says how it starts (the seed, given parameters, described or allocated). What the
    options add to it: the loss scale's state (`options.loss_scale`), the compressed reduction's
    (`layout.compressed`), and under `options.offload` the offloaded optimizer's state (in pinned
    host memory) in place of `tx`'s.
    """
    mesh, rules, compressed, offload = layout.mesh, layout.rules, layout.compressed, options.offload
    abstract = init.abstract or abstract_model(create_model, init.seed)
    rules_lib.warn_unnamed(abstract.unnamed)
    layouts = rules_lib.param_layouts(abstract.params, abstract.names, rules, mesh)
    param_shardings = rules_lib.layout_shardings(layouts, mesh)
    state_shardings = model_state_shardings(abstract, rules, mesh)
    shardings = TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=param_shardings,
        skipped_steps=NamedSharding(mesh, PartitionSpec()),
        opt_state=(opt_state_shardings(tx, abstract.params, param_shardings, mesh) if offload is None
                   else offload.shardings(abstract.params, param_shardings, mesh)),
        loss_scale=jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), options.loss_scale),
        model_state=state_shardings,
        loss_stats=jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), LossStats.create()),
        compression=None if compressed is None else compressed.state_shardings(param_shardings),
    )

    def initial(params: Any = None, model_state: Any = None) -> TrainState:
        if params is None:
            params, model_state = model_variables(create_model, init.seed)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params,
            opt_state=tx.init(params) if offload is None else offload.init(params),
            skipped_steps=jnp.zeros((), jnp.int32), loss_scale=options.loss_scale, model_state=model_state,
            loss_stats=LossStats.create(), compression=None if compressed is None else compressed.init(),
        )

    if init.materialize and init.params is not None:
        if (abstract.state is None) != (init.model_state is None):
            raise ValueError("starting from given parameters needs the model's other variables given too, where it "
                             "has any (BatchNorm's, a router's bias), and only there")
        model_state = None if init.model_state is None else init.model_state(state_shardings)
        state = jax.jit(initial, out_shardings=shardings, donate_argnums=(0, 1))(init.params(param_shardings),
                                                                                 model_state)
    elif init.materialize:
        state = jax.jit(initial, out_shardings=shardings)()
    else:
        state = with_shardings(jax.eval_shape(initial), shardings)
    return state, shardings, abstract.graphdef, layouts


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s of `shapes` carrying `shardings` (a matching tree): an abstract input."""
    return jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                        shapes, shardings)
