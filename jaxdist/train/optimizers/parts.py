"""What the optimizers share: the keys of Adam's moments, which parameters get weight decay (and
the trust ratio) by their roles, and the per-layer forms of optax's transformations for stacked
layers.

Masks are decided from each parameter's role (parallel/roles.py: weight, bias, norm, embedding),
which the model declares, never from its shape: by default weights get weight decay and the trust
ratio, embeddings the trust ratio only, biases and norms neither (`optim.decay_norms_and_biases`,
`optim.decay_embeddings` and `trust_ratio_norms_and_biases` ask otherwise).

Stacked layers are one array with a leading `layers` axis (a logical name). LARS and LAMB define the
trust ratio per layer, so for stacked parameters it is computed per slice along that axis;
Adafactor's per-parameter statistics are likewise per layer: `per_layer` vmaps them over the axis.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import optax
from pydantic import Field

from jaxdist.config import OptimizerSection
from jaxdist.parallel import roles as roles_lib


class AdamMoments(OptimizerSection):
    """The keys of Adam's two moments, for the optimizers built on Adam's update (AdamW, LAMB)."""

    moments: ClassVar[int] = 2
    b1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    b2: float = Field(0.95, ge=0, lt=1, description="second-moment decay")
    eps: float = Field(1e-8, gt=0, description="denominator epsilon")


class Masks(NamedTuple):
    """Trees like the parameters: their roles, whether each gets weight decay, and whether each is
    a stack of layers."""

    roles: Any
    decay: Any
    stacked: Any


Names = tuple[str | None, ...]
STACK_AXIS = "layers"


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def is_stacked(names: Names) -> bool:
    """A parameter holding every layer, stacked along a leading `layers` axis."""
    return names[:1] == (STACK_AXIS,)


def weight_decay_mask(optim: OptimizerSection, roles: Any) -> Any:
    """True for the parameters that get weight decay (a tree like the parameters' `roles`)."""

    def decays(role: str) -> bool:
        if role == roles_lib.EMBEDDING:
            return optim.decay_embeddings
        return role == roles_lib.WEIGHT or optim.decay_norms_and_biases

    return jax.tree.map(decays, roles)


def trust_ratio_mask(norms_and_biases: bool, roles: Any) -> Any:
    """True for the parameters whose LARS/LAMB update is scaled by the trust ratio: weights and
    embeddings, and norms and biases too with `norms_and_biases`."""
    return jax.tree.map(lambda role: norms_and_biases or roles_lib.is_weight(role), roles)


def stacked_mask(logical_names: Any) -> Any:
    return jax.tree.map(is_stacked, logical_names, is_leaf=_is_names)


def scale_by_layerwise_trust_ratio(
    mask: Any, stacked: Any, trust_coefficient: float = 1.0, eps: float = 0.0
) -> optax.GradientTransformation:
    """`optax.scale_by_trust_ratio` where `mask` says, one ratio per layer of stacked parameters.

    `mask` and `stacked` are trees of bools like the parameters. Leaves outside the mask pass
    through unchanged; stacked leaves get ||p_l|| / ||u_l|| for each layer l separately.
    """
    ratio = optax.scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)

    def scale_one(update: jax.Array, param: jax.Array) -> jax.Array:
        return ratio.update(update, ratio.init(param), param)[0]

    def scale_leaf(update, param, masked, layered):
        if not masked:
            return update
        return jax.vmap(scale_one)(update, param) if layered else scale_one(update, param)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs the parameters: pass them to update")
        return jax.tree.map(scale_leaf, updates, params, mask, stacked), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def per_layer(inner: optax.GradientTransformation, stacked: Any) -> optax.GradientTransformation:
    """`inner` with each layer of the stacked parameters as a parameter of its own.

    `stacked` is a tree of bools like the parameters. Stacked leaves go through `inner` vmapped
    over their leading `layers` axis (its state gets that axis too); the others as they are.
    """

    def init_fn(params):
        # vmap needs an array to map: there is none where no parameter is stacked, nor in the
        # placeholder tree optax.tree_map_params inits with
        return jax.vmap(inner.init)(params) if jax.tree.leaves(params) else inner.init(params)

    def update_fn(updates, state, params=None):
        if not jax.tree.leaves(updates):
            return inner.update(updates, state, params)
        return jax.vmap(inner.update)(updates, state, params)

    labels = jax.tree.map(lambda layered: "layers" if layered else "whole", stacked)
    return optax.partition({"layers": optax.GradientTransformation(init_fn, update_fn), "whole": inner}, labels)
