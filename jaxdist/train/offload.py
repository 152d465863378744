"""Host offload (`train.offload: optimizer`): the optimizer state lives in pinned host memory.

The state is born there (the init's out_shardings name the memory kind) and the step brings it to
the devices for the update one parameter at a time: each parameter's state is copied in, updated,
selected against the old one (the non-finite guard) and copied back out, and the copy-in of
parameter i waits for the update of parameter i - 1 (an optimization barrier). So one parameter's
state is updated on a device at a time (the copy out of one overlapping the copy in of the next),
whatever the whole state weighs; XLA would otherwise bring it all in at the step's start. Letting
two parameters' copies be in flight saved no time (the host link is the bound) and held more.

Each parameter has its own optimizer (built for its logical names and role alone, the masks included), so
the optimizer must act parameter by parameter: AdamW, LAMB and LARS (trust ratios per
parameter), Adafactor and SGD all do. Global-norm clipping, the one transformation across all
parameters, is applied to the gradients before, as `optax.clip_by_global_norm` does. The
optimizer state is a tuple of the parameters' states in their flattening order, so a checkpoint
of an offloaded run resumes offloaded.

Each step copies the whole state in and out once: its bytes over the host link (about 50 GB/s
each way on an H200's) bound the step from below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from jaxdist.train.state import opt_state_shardings

HOST_MEMORY = "pinned_host"  # host memory the devices copy from and to directly


def in_memory(shardings: Any, kind: str) -> Any:
    """`shardings` (NamedShardings; masked-out leaves kept) placing their arrays in memory `kind`
    ("device", or `HOST_MEMORY`)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind) if isinstance(s, NamedSharding) else s, shardings,
                        is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _nested(path: tuple, leaf: Any) -> Any:
    """A tree holding only `leaf`, at `path` (dict keys), as in the parameters."""
    for key in reversed(path):
        leaf = {key.key: leaf}
    return leaf


def _only_leaf(tree: Any) -> Any:
    return jax.tree.leaves(tree)[0]


class OffloadedOptimizer:
    """The optimizer applied one parameter at a time, its state in pinned host memory.

    `optimizer_for(names, roles)`: the optax transformation, without clipping, for the parameters
    whose logical names and roles are the trees `names` and `roles` (here always one parameter's).
    `clip_norm`: the global gradient norm above which the gradients are scaled down to it (None: no
    clipping).
    """

    def __init__(self, optimizer_for: Callable[[Any, Any], optax.GradientTransformation], names: Any, roles: Any,
                 clip_norm: float | None):
        flat, self._treedef = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
        self._paths = [path for path, _ in flat]
        self._optimizers = [optimizer_for(_nested(path, leaf_names), _nested(path, role))
                            for (path, leaf_names), role in zip(flat, self._treedef.flatten_up_to(roles))]
        self.clip_norm = clip_norm

    def _split(self, tree: Any) -> list[Any]:
        """Each parameter's leaf of a tree like the parameters, as a one-leaf tree."""
        return [_nested(path, leaf) for path, leaf in zip(self._paths, self._treedef.flatten_up_to(tree))]

    def init(self, params: Any) -> tuple[Any, ...]:
        return tuple(tx.init(one) for tx, one in zip(self._optimizers, self._split(params)))

    def shardings(self, abstract_params: Any, param_shardings: Any, mesh: Mesh) -> tuple[Any, ...]:
        """The state's shardings in host memory, each following its parameter's (`opt_state_shardings`)."""
        return tuple(
            in_memory(opt_state_shardings(tx, abstract, sharding, mesh), HOST_MEMORY)
            for tx, abstract, sharding in zip(self._optimizers, self._split(abstract_params),
                                              self._split(param_shardings)))

    def apply(self, grads: Any, grad_norm: jax.Array, opt_state: tuple[Any, ...], params: Any,
              applied: jax.Array, state_shardings: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """(new parameters, new state in host memory): each parameter updated where `applied`
        (else kept, with its state), in turn. Run inside the jitted step."""
        scale = 1.0 if self.clip_norm is None else jnp.where(grad_norm < self.clip_norm, 1.0, self.clip_norm / grad_norm)
        new_params, new_state = [], []
        for i, (tx, grad, param, host) in enumerate(zip(self._optimizers, self._split(grads), self._split(params),
                                                        opt_state)):
            if i:  # not before parameter i - 1 is updated: one parameter's state on the device at a time
                host, _ = jax.lax.optimization_barrier((host, new_params[i - 1]))
            old = jax.device_put(host, in_memory(state_shardings[i], "device"))
            updates, state = tx.update(jax.tree.map(lambda g: g * scale, grad), old, param)
            # The gradients are float32: the moments of bfloat16 parameters would come back promoted.
            state = jax.tree.map(lambda new, was: jnp.where(applied, new.astype(was.dtype), was), state, old)
            param = jax.tree.map(lambda p, u: jnp.where(applied, (p + u).astype(p.dtype), p), param, updates)
            new_params.append(_only_leaf(param))
            new_state.append(jax.device_put(state, state_shardings[i]))
        return self._treedef.unflatten(new_params), tuple(new_state)
